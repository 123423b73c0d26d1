"""What a sampled verification costs on CPU, piece by piece: the C++ kernels against the torch / numpy forms they
replace, timed side by side in one process (medians).

    python scripts/sampling_costs.py                          # one request verifying 1 draft, V = 49,152
    python scripts/sampling_costs.py --requests 16 --drafts 0  # a batch of 16 sampling without drafts

Pieces: the Exp(1) noise of a step (numpy PCG64 doubles and log1p, against exponentials), the probabilities p
(probs_from_logits on its torch path against temperature_softmax), the exponential race (torch against exp_race),
the rejection sampler on p and q (rejection_sample_ref against rejection_sample_cpu), and rejection_sample from
logits with every C++ piece off and on.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from minispec.kernels import cpu
from minispec.sample import sampler
from minispec.sample.random import exponentials
from minispec.spec_decode import rejection_sampler as rs


def median_ms(fn, reps: int) -> float:
    """Median milliseconds of fn over reps calls, after a few untimed ones."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def numpy_noise(gens, vocab: int) -> torch.Tensor:
    """The noise as it was drawn before exp_noise: vocab PCG64 doubles per row, -log1p(-u), to float32."""
    u = np.empty((len(gens), vocab))
    for i, g in enumerate(gens):
        g.random(out=u[i])
    return torch.from_numpy((-np.log1p(-u)).astype(np.float32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--drafts", type=int, default=1, help="drafts each request verifies")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if cpu.ops() is None:
        raise SystemExit("the C++ kernels could not be built: nothing to compare")
    torch.set_num_threads(args.threads)
    n, k, vocab = args.requests, args.drafts, args.vocab
    g = torch.Generator().manual_seed(0)
    num_logits = n * (k + 1)
    target = 3 * torch.randn(num_logits, vocab, generator=g)
    draft = torch.full((num_logits, vocab), float("-inf"))
    subset = torch.randperm(vocab, generator=g)[: max(1, vocab // 6)]  # a draft vocabulary, -inf elsewhere
    draft[:, subset] = target[:, subset] + torch.randn(num_logits, len(subset), generator=g)
    cu = torch.arange(n + 1) * (k + 1)
    temperature, top_k, top_p = torch.full((n,), args.temperature), torch.zeros(n, dtype=torch.long), torch.ones(n)
    t_pos = temperature.repeat_interleave(k + 1)
    draft_tokens = subset[torch.randint(0, len(subset), (num_logits,), generator=g)]
    draft_tokens[cu[1:] - 1] = -1
    u = torch.rand(n, max(k, 1), generator=g)
    gens = [np.random.Generator(np.random.PCG64(i)) for i in range(n)]
    noise = exponentials(gens, vocab)
    p, q = rs._probs(target, draft, cu, temperature, top_k, top_p)

    k_pos, p_pos = top_k.repeat_interleave(k + 1), top_p.repeat_interleave(k + 1)

    def without_cpp(fn):
        """fn() with rejection_sample_cpu and temperature_softmax off: the torch paths beside them."""
        def run():
            saved = rs.rejection_sample_cpu, sampler._plain_softmax
            rs.rejection_sample_cpu, sampler._plain_softmax = rs.rejection_sample_ref, lambda *a: None
            try:
                return fn()
            finally:
                rs.rejection_sample_cpu, sampler._plain_softmax = saved
        return run

    def probs():
        return sampler.probs_from_logits(target, t_pos, k_pos, p_pos)

    def verify():
        return rs.rejection_sample(target, draft, draft_tokens, None, cu, temperature, top_k, top_p, u[:, :k], noise)

    pieces = [
        ("Exp(1) noise [n, V]", lambda: numpy_noise(gens, vocab), lambda: exponentials(gens, vocab)),
        ("p = probs_from_logits (softmax(logits / T))", without_cpp(probs), probs),
        ("race argmax(p / noise) at the bonus rows",
         lambda: (p[cu[1:] - 1] / noise.clamp(sampler.NOISE_MIN, sampler.NOISE_MAX)).argmax(-1),
         lambda: sampler.sample(p[cu[1:] - 1].contiguous(), noise)),
        ("rejection sampler on p, q", lambda: rs.rejection_sample_ref(p, q, draft_tokens, None, cu, u[:, :k], noise),
         lambda: rs.rejection_sample_cpu(p, q, draft_tokens, None, cu, u[:, :k], noise)),
        ("rejection_sample from logits", without_cpp(verify), verify),
    ]
    print(f"{n} request(s) x {k} draft(s), V = {vocab}, T = {args.temperature}, {args.threads} threads, "
          f"medians of {args.reps}")
    print("| piece | torch / numpy ms | C++ ms | ratio |")
    print("|---|---|---|---|")
    for name, old, new in pieces:
        a, b = median_ms(old, args.reps), median_ms(new, args.reps)
        print(f"| {name} | {a:.3f} | {b:.3f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
