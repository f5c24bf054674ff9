"""Node agent: owns one device; runs the GR model, the HBM arena (EMB slab + KV page pool), the
Memory Manager and the SmartAllocator. See `node_agent.memory` for the memory subsystem."""
