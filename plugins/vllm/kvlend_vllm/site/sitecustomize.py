"""Run at the start of every Python process of a vLLM engine the launcher starts (on its PYTHONPATH).

Asks for AMX tile state before any thread or library can get in the way (``kvlend_vllm.amx``).
With ``KVLEND_CPU_DEVICE_INDEX_SHIM`` set (MooncakeConnector baselines only), makes
``torch.accelerator.current_device_index()`` return 0 on a host without an accelerator: vLLM's
MooncakeConnector worker calls it and it raises on a CPU-only torch.
"""

import os

try:
    from kvlend_vllm.amx import request_amx
except ImportError:  # kvlend_vllm is not importable in this interpreter: nothing to do
    pass
else:
    request_amx()

if os.environ.get("KVLEND_CPU_DEVICE_INDEX_SHIM"):
    import torch

    if not torch.accelerator.is_available():
        torch.accelerator.current_device_index = lambda: 0
