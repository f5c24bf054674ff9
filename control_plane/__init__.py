"""The control plane: the versioned HTTP API over the SQL history, the router weights it derives
and pushes, policy and model rollouts, scheduled jobs, auth and settings (one process, `racer
control-plane`); see docs/control_plane.md."""
