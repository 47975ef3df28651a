"""GRPO training with prefix reuse under torchrun: any TP x PP x DP layout, Megatron's optimizer.

    torchrun --nproc-per-node 8 examples/train_grpo_megatron.py --tp 2 --pp 2    # GPU: NCCL
    torchrun --nproc-per-node 2 examples/train_grpo_megatron.py --pp 2 --cpu     # CPU: gloo

The skeleton of a real trainer: every rank builds the same synthetic GRPO batch (in a real
trainer: the rollout), `place_groups` gives each data-parallel rank whole groups,
`plan_microbatches` packs that rank's suffixes, `ReuseStep` carries plan + schedule + cache into
Megatron's `get_forward_backward_func()` (prefix reuse selected), Megatron's DDP and
`finalize_model_grads` normalise by the global loss-token count, and Megatron's optimizer steps.
`--dense` runs the same steps with the stock dense schedule for comparison. Swap in your model
builder and rollout; nothing else changes.

A stalled or dead rank ends the job within `--collective-timeout` seconds (default
`$PREFIX_REUSE_COLLECTIVE_TIMEOUT_S`, else 600), at start-up as mid-run: the default group's
rendezvous and every process group the step uses get it as their timeout, so a rank waiting that
long for a peer fails; its error then names the rank that failed first
(megatron_patches/support/failures.py: ranks record how they ended in torchrun's store; one
that recorded nothing stalled or was killed), and torchrun stops the others. On gloo the waiting
collective raises. On NCCL PyTorch's watchdog enforces the same timeout
(TORCH_NCCL_ASYNC_ERROR_HANDLING, which torchrun sets to 1: abort the communicator and end the
process), so the waiting ranks may end before they can report; set TORCH_NCCL_DESYNC_DEBUG=1 to
have the watchdog log which ranks never joined the timed-out collective.

How long a stall takes to end the job: the timeout, then up to 5 s in which the failing rank
collects its peers' ends (for the headline), then torchrun stops the other ranks with SIGTERM;
a rank that does not end on SIGTERM (a stopped process, one stuck in the kernel) gets torchrun's
fixed 30 s shutdown grace before SIGKILL. So: timeout + 5 s, or timeout + 35 s at worst. A slow
start-up (imports, data) counts against the same timeout: give a larger one for huge jobs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

import megatron_patches
from megatron_patches.support.failures import collective_timeout_s, report_first_failure
from megatron_patches.models.tiny import TinyLlamaConfig, build_model, initialize_distributed

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--max-response-len", type=int, default=48)
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--prefix-chunk-tokens", type=int, default=None)
    p.add_argument("--offload-prefix-activations", action="store_true",
                   help="park Phase A's saved activations in pinned host memory until Phase C")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dense", action="store_true", help="stock dense schedule instead of reuse")
    p.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                   help="a collective or p2p waiting this long for a peer fails the job, naming "
                        "the rank that failed first (default: $PREFIX_REUSE_COLLECTIVE_TIMEOUT_S, "
                        "else 600)")
    p.add_argument("--stall-rank", type=int, default=None,
                   help="testing aid: this rank sleeps forever before its first step")
    p.add_argument("--stall-at", choices=("step", "startup"), default="step",
                   help="testing aid: where --stall-rank sleeps (startup: before the default "
                        "process group exists)")
    p.add_argument("--cpu", action="store_true",
                   help="train on CPU over gloo (turns on megatron_patches.enable_cpu_support)")
    args = p.parse_args(argv)
    if args.collective_timeout is None:
        args.collective_timeout = collective_timeout_s(600.0)
    if not args.collective_timeout > 0:
        p.error(f"--collective-timeout {args.collective_timeout}: give seconds > 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % (args.tp * args.pp):
        p.error(f"world size {world} is not divisible by tp*pp = {args.tp * args.pp}")
    args.dp = world // (args.tp * args.pp)
    return args


def rollout(args, vocab_size: int):
    """Stand-in for generation + reward: the same on every rank (seeded)."""
    from prefix_schedule import Group, GroupBatch, Trajectory, grpo_advantages

    gen = torch.Generator().manual_seed(args.seed)
    groups = []
    for _ in range(args.num_groups):
        prompt = torch.randint(0, vocab_size, (args.prefix_len,), generator=gen)
        lengths = torch.randint(8, args.max_response_len + 1, (args.group_size,), generator=gen)
        responses = [torch.randint(0, vocab_size, (int(n),), generator=gen) for n in lengths]
        rewards = torch.tensor([(r < vocab_size // 2).float().mean().item() for r in responses])
        advantages = grpo_advantages(rewards)
        groups.append(Group(prefix=prompt, trajectories=[
            Trajectory(suffix=r, advantages=float(a)) for r, a in zip(responses, advantages)]))
    return GroupBatch(groups=groups)


def _store(timeout: datetime.timedelta):
    """A client of the job's store (torchrun hosts it in its agent, so it outlives any rank)."""
    return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                      is_master=False, timeout=timeout)


@record  # torchrun's failure summary shows the error (the headline of report_first_failure)
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        megatron_patches.enable_cpu_support()  # explicit: a GPU job never falls back to CPU
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device is available: pass --cpu to train on CPU over gloo")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=args.collective_timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    key = f"prefix_reuse/end/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    with report_first_failure(_store(timeout), rank, world, key=key):
        if args.stall_at == "startup" and rank == args.stall_rank:
            time.sleep(10**9)
        # start-up waits for every rank as long as any collective does, and its failure is
        # reported like one (a rank that never arrives is named)
        torch.distributed.init_process_group("gloo" if args.cpu else "nccl", timeout=timeout)
        megatron_patches.install()
        # every group the step uses gets the collective timeout: Megatron's, and `everyone`
        initialize_distributed(seed=1234 + args.seed, tp=args.tp, pp=args.pp,
                               timeout_s=args.collective_timeout)
        everyone = torch.distributed.new_group(timeout=timeout)
        train(args, everyone)
    torch.distributed.destroy_process_group()
    return 0


def train(args, everyone) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_patches.runtime.agreement import refuse_step
    from megatron_patches.runtime.finite_grads import agree_finite_grads
    from megatron_patches.rl import make_policy_forward_step
    from megatron_patches.training import prepare_for_training
    from prefix_schedule import PolicyLossConfig, ReuseStep, plan_microbatches
    from prefix_schedule.planning.placement import place_groups

    cfg = TinyLlamaConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                          ffn_hidden_size=args.hidden_size * 8 // 3 // 16 * 16,
                          max_seq_len=args.prefix_len + args.max_response_len)
    model = build_model(cfg)  # this pipeline stage's layers
    model = prepare_for_training(model, ddp=True)  # Megatron DDP + finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, params_dtype=cfg.params_dtype,
        clip_grad=0.0 if args.cpu else 1.0), [model])  # CPU: no clipping
    loss_config = PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    rank0 = torch.distributed.get_rank() == 0

    for step in range(args.steps):
        stall = args.stall_at == "step" and torch.distributed.get_rank() == args.stall_rank
        if step == 0 and stall:
            time.sleep(10**9)
        args.seed += 1
        batch = rollout(args, cfg.vocab_size)
        placement = place_groups(batch, dp_size=args.dp, token_budget=args.token_budget,
                                 max_seq_len=cfg.max_seq_len)
        local = placement.ranks[ps.get_data_parallel_rank()].batch
        model.zero_grad_buffer()
        optimizer.zero_grad()
        start = time.perf_counter()
        with megatron_patches.use_prefix_reuse_schedule(not args.dense):
            forward_backward = get_forward_backward_func()
        if args.dense:
            from megatron_patches.training import dense_items

            data, num_microbatches = dense_items(local), sum(
                len(g.trajectories) for g in local.groups)
        else:
            try:  # this rank's own data: refused on every rank together, never a hang
                plan = plan_microbatches(local, token_budget=args.token_budget,
                                         max_seq_len=cfg.max_seq_len,
                                         prefix_chunk_tokens=args.prefix_chunk_tokens)
                data = ReuseStep(local, plan, num_stages=args.pp,
                                 offload_prefix_activations=args.offload_prefix_activations)
            except ValueError as error:  # the others wait at the executor's agreement point
                refuse_step(model, error)
            num_microbatches = data.num_microbatches
        reports = forward_backward(forward_step_func=make_policy_forward_step(loss_config),
                                   data_iterator=data, model=[model],
                                   num_microbatches=num_microbatches, seq_length=0,
                                   micro_batch_size=1)
        agree_finite_grads(model, step=step)  # NaN/inf gradients stop every rank here
        _, grad_norm, _ = optimizer.step()
        seconds = time.perf_counter() - start
        # loss sum, tokens (last stage reports); on the model's device: NCCL reduces it
        totals = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
        for report in reports:
            totals += report["loss"].double()
        torch.distributed.all_reduce(totals, group=everyone)  # same ratio on every TP/PP copy
        if rank0:
            if step == 0:
                print(placement.describe())
            print(f"step {step}: loss {totals[0] / totals[1]:.6f}  grad norm {grad_norm:.4f}  "
                  f"{seconds:.2f} s  ({'dense' if args.dense else 'prefix reuse'}, "
                  f"tp={args.tp} pp={args.pp} dp={args.dp})", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
