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
        from megatron_patches.support.cpu_support import enable_cpu_support, cpu_support_enabled
        changed = enable_cpu_support()
        same = original == (torch.cuda.current_device, torch.cuda.synchronize,
                            torch.cuda.current_stream)
        print(changed, cpu_support_enabled(), same)
    """)
    assert line == "False False True"


def test_enables_megatron_import_and_cpu_devices_without_cuda():
    line = _run("""
        import torch
        from megatron_patches.support.cpu_support import enable_cpu_support
        assert enable_cpu_support() and enable_cpu_support()  # idempotent
        import megatron.core  # would fail on `import triton` without the stub
        from megatron.core.transformer.utils import get_default_causal_mask
        print(torch.cuda.current_device(), get_default_causal_mask(3).device)
    """)
    assert line == "cpu cpu"


def test_nothing_turns_it_on_implicitly():
    """Importing the package or the model builders, and install(), leave torch.cuda alone: only
    an explicit enable_cpu_support() does it (a GPU node with a broken driver must fail loudly,
    not train on CPU)."""
    line = _run("""
        import torch
        original = torch.cuda.current_device
        import megatron_patches
        from megatron_patches.models import tiny as models  # stubs a missing triton, nothing else
        megatron_patches.install()
        from megatron_patches.support.cpu_support import cpu_support_enabled
        print(torch.cuda.current_device is original, cpu_support_enabled())
    """)
    assert line == "True False"


def test_refused_when_the_default_process_group_is_nccl():
    line = _run("""
        import torch.distributed as dist
        dist.is_initialized = lambda: True
        dist.get_backend = lambda group=None: "nccl"
        import megatron_patches
        try:
            megatron_patches.enable_cpu_support()
        except ValueError as error:
            print("refused" if "NCCL" in str(error) else error)
        else:
            print("enabled")
    """)
    assert line == "refused"


def test_reuse_step_refused_when_the_layer_meets_nccl(megatron_env, monkeypatch):
    """The layer was turned on, then an NCCL group appeared: the step is refused before compute."""
    import pytest
    import torch

    from megatron_patches.models.tiny import TinyLlamaConfig, build_model
    from megatron_patches.training import reuse_step, scale_grads_by_token_count
    from prefix_schedule.planning.planner import plan_microbatches
    from test_equivalence import LOSS, make_batch

    model = build_model(TinyLlamaConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64,
                                        num_attention_heads=2, num_query_groups=1,
                                        vocab_size=256, max_seq_len=64))
    model.config.finalize_model_grads_func = scale_grads_by_token_count
    batch = make_batch(3, [(8, [3, 4])])
    plan = plan_microbatches(batch, token_budget=8, max_seq_len=64)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="NCCL"):
        reuse_step(model, batch, plan, LOSS)
    assert not calls
