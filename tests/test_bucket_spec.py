"""``BucketSpec.mark_nan`` (the non-finite propagation both front doors use): element 0
of every flagged non-empty layer becomes NaN, nothing else changes; empty layers -- at
the start, in the middle, at the end, or all of them -- are skipped, whatever their flag.
Checked against a per-layer Python loop on fresh random data and flags."""
import math

import pytest
import torch

from hvdsparse.exchange.base import BucketSpec


@pytest.mark.parametrize("numels", [[5, 3, 7], [0, 4, 6], [4, 0, 6], [4, 6, 0],
                                    [0, 0], [1, 0, 0, 2, 0]])
def test_mark_nan_matches_a_per_layer_loop(numels):
    g = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    spec = BucketSpec.build(0, [f"l{j}" for j in range(len(numels))], numels)
    for _ in range(8):
        flat = torch.randn(spec.numel, generator=g)
        flags = torch.rand(len(numels), generator=g) < 0.5
        want = flat.clone()
        for j, (o, n) in enumerate(zip(spec.offsets, spec.numels)):
            if n > 0 and bool(flags[j]):
                want[o] = math.nan
        got = flat.clone()
        spec.mark_nan(got, flags, spec.first_elements(got.device))
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (numels, flags)
        fin = ~torch.isnan(want)
        assert torch.equal(got[fin], want[fin])
