"""The CPU/gloo support layer is opt-in and changes nothing where CUDA exists."""

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_noop_when_cuda_is_available():
    line = _run("""
        import torch
        torch.cuda.is_available = lambda: True
        original = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream)
        from megatron_patches.cpu_support import enable_cpu_support, cpu_support_enabled
        changed = enable_cpu_support()
        same = original == (torch.cuda.current_device, torch.cuda.synchronize,
                            torch.cuda.current_stream)
        print(changed, cpu_support_enabled(), same)
    """)
    assert line == "False False True"


def test_enables_megatron_import_and_cpu_devices_without_cuda():
    line = _run("""
        import torch
        from megatron_patches.cpu_support import enable_cpu_support
        assert enable_cpu_support() and enable_cpu_support()  # idempotent
        import megatron.core  # would fail on `import triton` without the stub
        from megatron.core.transformer.utils import get_default_causal_mask
        print(torch.cuda.current_device(), get_default_causal_mask(3).device)
    """)
    assert line == "cpu cpu"
