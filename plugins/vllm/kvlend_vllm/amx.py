"""Ask Linux for AMX tile state, once per process, before anything may use it.

Linux gives a process the AMX tile registers only on request (``arch_prctl``,
what ``torch._C._cpu._init_amx()`` does), and refuses the request once a thread
has a signal stack too small for the AMX state.  vLLM's CPU worker runs its bf16
attention with AMX on CPUs that have it but does not always ask first: a worker,
plain or with a KV connector, died of SIGILL (exit code -4) on its first bf16
request, more often on a busy host.  Asking at interpreter start prevents it.
Standard library only: ``site/sitecustomize.py`` calls it in every process of
an engine the launcher starts.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx() -> bool:
    """True if this process may now use AMX tiles; False where the CPU, kernel or OS has none."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
