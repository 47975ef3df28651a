"""Plumbing of examples/megatron_lm/train_rl_prefix_reuse.py with a stand-in train_rl.py (run by
tests/test_megatron_rl_train_rl.py on the Megatron-LM main checkout): `--prefix-reuse` is taken
out of train_rl's arguments, and when train_rl calls `pretrain` the TrainRLReuse hooks are in
place for its forward_step / loss_func; bad arguments are refused before pretrain runs. The real
`pretrain` is replaced by a recorder. On CPU (the launcher's CPU mode): `--replay-trace`
becomes a `--langrl-env-config` naming the replay agent, and a run with neither is refused
before train_rl.py runs. The real (the whole run, rollouts replayed through train_rl's agent
registry: tests/test_megatron_rl_train_rl_run.py)."""
import sys
from pathlib import Path

STAND_IN = '''
import sys
from argparse import Namespace as NAMESPACE
from megatron.training import pretrain
from megatron.training.global_vars import set_args
def loss_func(*args): pass
def forward_step(data_iterator, model): pass
set_args(NAMESPACE(rl_use_sequence_packing=False, rl_inference_logprobs_is_correction=False,
                   calculate_per_token_loss="--calculate-per-token-loss" in sys.argv,
                   pipeline_model_parallel_size=1, context_parallel_size=1, grpo_group_size=4))
pretrain(None, None, None, forward_step, None)
'''


def main(tmp: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "megatron_lm"))
    import train_rl_prefix_reuse as launcher
    from megatron_patches.megatron_lm.rl_replay import AGENT_NAME, synth_trace
    from megatron_patches.megatron_lm import compat

    compat.enable_python311_support()
    compat.enable_megatron_lm_cpu_support()
    from megatron_patches.megatron_lm.rl_cpu import stub_missing_modules

    stub_missing_modules()  # wandb when absent (rl_cpu.py says why)
    import megatron.training
    from megatron.rl import rl_utils
    from megatron.training import training

    script = Path(tmp) / "train_rl.py"
    script.write_text(STAND_IN)
    seen = {}
    stock = (training.get_forward_backward_func, rl_utils.compute_logprobs_batch)

    def recorder(full_config, datasets_provider, model_type, forward_step_func, provider):
        seen.update(argv=list(sys.argv), hooked=(training.get_forward_backward_func,
                                                 rl_utils.compute_logprobs_batch),
                    step=forward_step_func)
    megatron.training.pretrain = recorder
    trace = Path(tmp) / "trace.json"
    synth_trace(str(trace), collections=1, groups=1, group_size=4, eod=255, vocab_size=256)
    launcher.main(["--train-rl", str(script), "--calculate-per-token-loss", "--prefix-reuse",
                   "--replay-trace", str(trace)])
    argv = seen["argv"]
    assert argv[:3] == [str(script), "--calculate-per-token-loss", "--langrl-env-config"], argv
    assert len(argv) == 4 and AGENT_NAME in Path(argv[3]).read_text(), argv
    assert str(trace.resolve()) in Path(argv[3]).read_text()
    assert seen["hooked"][0] is not stock[0] and seen["hooked"][1] is not stock[1]
    hook = seen["hooked"][1].__self__
    assert hook.train_forward_step is seen["step"] and hook.group_size == 4
    assert hook.loss_func.__name__ == "loss_func"
    training.get_forward_backward_func, rl_utils.compute_logprobs_batch = stock
    seen.clear()
    try:
        launcher.main(["--train-rl", str(script), "--prefix-reuse", "--replay-trace", str(trace)])
    except launcher.RefusedArguments as error:
        assert "--calculate-per-token-loss" in str(error) and not seen, error
    else:
        raise AssertionError("no --calculate-per-token-loss was not refused")
    import torch

    no_trace = [] if torch.cuda.is_available() else [([], "--replay-trace TRACE.json")]
    for argv, message in (*no_trace,
                          (["--replay-trace", str(script)], "not a readable JSON trace"),
                          (["--replay-trace", str(trace), "--langrl-env-config", "x.yaml"],
                           "not both")):
        try:
            launcher.main(["--train-rl", str(script), "--calculate-per-token-loss", *argv])
        except launcher.RefusedArguments as error:
            assert message in str(error) and not seen, error
        else:
            raise AssertionError(f"{argv} was not refused")
    print("launcher ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
