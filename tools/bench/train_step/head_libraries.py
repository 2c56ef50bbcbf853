"""A maintained LM-head kernel against agrpo-attention's fused head, for what the GRPO loss needs: the
log-probs of each trained token and of the sampler's top-K ids, and their backward, without (M, V) logits.

cut-cross-entropy's `linear_cross_entropy` (Triton; one target per position, reduction "none") gives the
cross entropy CE = lse - <e, c_target>; the top-K log-probs follow from the logsumexp it implies,
lse = CE + <e, c_target>, as <e, c_k> - lse (a gather of K weight rows), and the gradient of lse reaches
CCE's own backward through CE. Both heads run on the same (M, H) hidden states of Qwen3-1.7B's head
(H 2048, V 151936, fp32 master weights under bf16 autocast as the trainer runs it; CCE gets bf16 copies),
M = 14k terms (a ratio-1 row) and 4k (ratio 3.4), K = 8. Printed: forward + backward ms (median of 5 after a
warm-up), peak memory above the inputs, and the largest error of log-probs and of both gradients against
an fp32 reference. GPU only (CCE is Triton): `python -m tools.bench.train_step.head_libraries`; liger-kernel
is not measured (see docs/benchmarks.md: its GRPO loss gives the target's log-prob only, its own loss).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from agrpo_attention._token_logprobs import _HeadGatheredLogSoftmax


def ours(hidden, weight, ids):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        gathered, _ = _HeadGatheredLogSoftmax.apply(
            hidden, weight, ids, ids.new_empty(ids.shape[0], 0), 1.0, torch.bfloat16
        )
    return gathered


def cce(hidden, weight, ids, filter_eps):
    from cut_cross_entropy import linear_cross_entropy

    e, c = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    ce = linear_cross_entropy(e, c, ids[:, 0], reduction="none", filter_eps=filter_eps)
    picked = torch.einsum("mh,mkh->mk", e.float(), c[ids].float())  # <e, c_id> for the target and the top-K
    lse = ce.float() + picked[:, 0]
    return picked - lse[:, None]


def reference(hidden, weight, ids):
    logits = hidden.float() @ weight.float().T
    return torch.log_softmax(logits, -1).gather(1, ids)


def _run(fn, hidden, weight, ids, upstream):
    hidden.grad = weight.grad = None
    out = fn(hidden, weight, ids)
    (out * upstream).sum().backward()
    return out.detach(), hidden.grad.detach().clone(), weight.grad.detach().clone()


def _time(fn, hidden, weight, ids, upstream) -> tuple[float, float]:
    _run(fn, hidden, weight, ids, upstream)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _run(fn, hidden, weight, ids, upstream)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--terms", default="14000,4000")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device="cuda") * 0.02).requires_grad_()
    candidates = {"agrpo fused head": ours, "cce filter_eps=high": lambda h, w, i: cce(h, w, i, "high"),
                  "cce filter_eps=None": lambda h, w, i: cce(h, w, i, None)}  # fmt: skip
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; H {args.hidden}, V {args.vocab}, K {args.top_k}"
    )
    for terms in (int(t) for t in args.terms.split(",")):
        hidden = torch.randn(terms, args.hidden, device="cuda").requires_grad_()
        ids = torch.randint(0, args.vocab, (terms, 1 + args.top_k), device="cuda")
        upstream = torch.randn(terms, 1 + args.top_k, device="cuda")
        ref = _run(reference, hidden, weight, ids, upstream)
        for name, fn in candidates.items():
            try:
                got = _run(fn, hidden, weight, ids, upstream)
                ms, peak = _time(fn, hidden, weight, ids, upstream)
            except (RuntimeError, ValueError, ImportError, AssertionError) as error:  # reported, not fatal
                print(f"  M {terms:6d}  {name:<22} failed: {type(error).__name__}: {str(error)[:200]}")
                continue
            errors = [float((g - r).abs().max() / r.abs().max()) for g, r in zip(got, ref, strict=True)]
            print(f"  M {terms:6d}  {name:<22} fwd+bwd {ms:7.1f} ms  peak +{peak:5.2f} GiB  max rel error "
                  f"log-probs {errors[0]:.1e}, d hidden {errors[1]:.1e}, d weight {errors[2]:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
