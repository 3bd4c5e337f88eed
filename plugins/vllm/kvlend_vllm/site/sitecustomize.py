"""Run at the start of every Python process of a vLLM engine the launcher starts (on its PYTHONPATH).

Asks for AMX tile state before any thread or library can get in the way (``kvlend_vllm.amx``).
"""

try:
    from kvlend_vllm.amx import request_amx
except ImportError:  # kvlend_vllm is not importable in this interpreter: nothing to do
    pass
else:
    request_amx()
