"""The modules the workers' forkserver preloads leave CUDA alone: workers forked from it can still use the GPU."""

import subprocess
import sys

from runner.launch.preload import PRELOAD, SERVER_ENV

# Every way torch starts CUDA in a process (after which a forked child cannot use it), counted while PRELOAD imports.
PROBE = f"""
import torch, torch.cuda
calls = []
def counting(owner, name):
    original = getattr(owner, name, None)
    if original is not None:
        setattr(owner, name, lambda *a, **k: calls.append(name) or original(*a, **k))
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_properties",
             "get_device_capability", "is_bf16_supported", "mem_get_info"):
    counting(torch.cuda, name)
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    counting(torch._C, name)
import importlib
for module in {list(PRELOAD)!r}:
    importlib.import_module(module)
print(sorted(set(calls)))
"""


def test_the_preloaded_modules_never_ask_torch_about_cuda_while_they_import():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_server_is_marked_as_the_engines_start_marks_it():
    from runner.engine import forkserver  # this module cannot import it (torch): the name is written twice

    assert SERVER_ENV == forkserver.SERVER_ENV
