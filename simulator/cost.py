"""The simulator's cost model: how long a node takes to serve a micro-batch.

The model is `common.device_model`'s (its module docstring states it), the one definition the
emulated node agent charges too; re-exported here.
"""

from common.device_model import (batch_duration_us, batch_time_us, extra_passes_us,  # noqa: F401 (re-exported)
                                 request_compute_us, user_passes)
