"""Rollouts shaped like what RL frameworks hand Megatron, and the reuse == dense check that the
framework tests share (tests/test_adapter*.py)."""
import torch

SMALL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4,
             num_query_groups=2, vocab_size=256, max_seq_len=256)
TOL = 1e-5


def grpo_sequences(seed, *, groups=((40, 4), (36, 3)), tree_group=True, lone_group=True,
                   tree_loss_start=30):
    """Per sequence (tokens, first response index, group id): groups of G samples of one prompt
    (prompt length, G), one group whose samples share only part of the prompt (a tree: two
    follow-ups of one system prompt, trained on from `tree_loss_start`: 30 puts loss tokens
    inside the shared follow-up nodes), one group of unrelated prompts (runs dense)."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(1, 256, (n,), generator=gen)
    out = []
    for gid, (prompt_len, g) in enumerate(groups):
        prompt = tokens(prompt_len)
        for _ in range(g):
            out.append((torch.cat([prompt, tokens(int(torch.randint(4, 12, (1,), generator=gen)))]),
                        prompt_len, f"uid-{gid}"))
    if tree_group:
        system = tokens(30)
        for k in range(2):
            follow = tokens(18)
            for _ in range(2):
                out.append((torch.cat([system, follow, tokens(6 + k)]), tree_loss_start, "uid-tree"))
    if lone_group:
        for _ in range(2):
            out.append((tokens(15), 9, "uid-lone"))
    return out, gen


def rollout_arrays(seqs, gen):
    """Per-sequence loss mask (response, some tokens masked out), advantages (one per sequence),
    old and reference log-probs."""
    masks, adv, old, ref = [], [], [], []
    for tok, start, _ in seqs:
        n = tok.numel()
        m = torch.zeros(n)
        m[start:] = (torch.rand(n - start, generator=gen) > 0.15).float()
        m[start] = 1.0
        masks.append(m)
        adv.append(float(torch.randn(1, generator=gen)))
        old.append(-torch.rand(n, generator=gen) * 4 - 0.5)
        ref.append(-torch.rand(n, generator=gen) * 4 - 0.5)
    return masks, adv, old, ref


def grads_of(model):
    from megatron_patches.training import param_grads
    return param_grads(model)


def assert_grads_equal(reference, other, tol=TOL):
    from megatron_patches.training import max_relative_diff, missing_grads
    for name, g in list(reference.items()) + list(other.items()):
        assert torch.isfinite(g).all(), f"{name}: NaN or inf in a gradient"
    missing = missing_grads(reference=reference, other=other)
    assert not missing, f"no (or a non-finite) gradient: {missing[:5]}"
    diff = max_relative_diff(reference, other)
    assert diff <= tol, f"max relative gradient difference {diff:.3e}"
    return diff


def run_both(model, rollout, loss_fn, *, micro_batches, config=None, reuse_loss_fn=None):
    """(dense result, dense grads, reuse result, reuse grads) of one step each."""
    from megatron_patches.frameworks import PrefixReuseAdapter, dense_forward_backward
    from megatron_patches.training import zero_grads

    zero_grads(model)
    dense = dense_forward_backward(model, rollout, loss_fn, micro_batches=micro_batches,
                                   config=config)
    dense_grads = grads_of(model)
    zero_grads(model)
    reuse = PrefixReuseAdapter(model, config).forward_backward(rollout, reuse_loss_fn or loss_fn)
    return dense, dense_grads, reuse, grads_of(model)


def reported_sum(result, key="loss"):
    return sum(float(r[key]) for r in result.losses_reduced)
