"""FP8 numerics diagnostics on the GPU: per shape, cute_sm90's relative error against fp64 math on the
dequantised inputs, FP8's inherent error (testing.fp8_peer) and the LSE's max error.

    python benchmarks/fp8_errors.py
"""

from __future__ import annotations

import argparse

import torch

import attnforge
from attnforge.testing import fp8_peer, oracle, rel_error


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for (b, hq, hkv, nq, nk) in [(1, 2, 2, 1, 1), (2, 4, 2, 113, 1023), (1, 4, 1, 1023, 113), (1, 8, 8, 1024, 1024)]:
        for d in (64, 128, 256):
            for causal in (False, True):
                g = torch.Generator().manual_seed(0)
                x = [torch.randn(b, h, n, d, generator=g).to("cuda") for h, n in ((hq, nq), (hkv, nk), (hkv, nk))]
                for unit in (True, False):
                    descale = [torch.ones(b, hkv, device="cuda") if unit
                               else (t.reshape(b, hkv, -1).abs().amax(-1) / 448) for t in x]
                    per_head = [s.repeat_interleave(t.shape[1] // hkv, 1)[:, :, None, None] for s, t in zip(descale, x)]
                    fp8 = [(t / s).to(torch.float8_e4m3fn) for t, s in zip(x, per_head)]
                    deq = [f.float() * s for f, s in zip(fp8, per_head)]
                    out, lse = attnforge.attention(*fp8, causal=causal, return_lse=True, q_descale=descale[0],
                                                   k_descale=descale[1], v_descale=descale[2], backend="cute_sm90")
                    ref, ref_lse, _ = oracle(*deq, causal=causal)
                    fin = ref_lse.isfinite()
                    bf = attnforge.attention(*(t.to(torch.bfloat16) for t in deq), causal=causal, backend="cute_sm90")
                    print(f"{b}x{hq}x{hkv}x{nq}x{nk} d={d} {'causal' if causal else 'full  '} "
                          f"{'unit ' if unit else 'amax '}descale: err {rel_error(out, ref):.4f} inherent "
                          f"{rel_error(fp8_peer(*deq, causal=causal), ref):.4f} bf16 {rel_error(bf, ref):.4f} "
                          f"lse maxerr {(lse.double() - ref_lse)[fin].abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    main()
