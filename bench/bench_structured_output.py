"""What structured output costs a decode round: the host's mask fill (xgrammar's matchers, one
row each, at a JSON schema's states) and the sampler's extra work on the device (unpacking the
bitmask and masking the logits), at V4's vocabulary (129280) and 1-64 constrained rows.

  python bench/bench_structured_output.py [--device cuda]

`fill_us`: the host time of GrammarBackend.token_bitmask for the rows (the runner calls it at
each constrained round's launch); `sample_us` / `sample_masked_us`: the sampler on the same
logits without and with the mask (greedy rows and temperature-1 rows half each); the roofline of
the device side is the unmasked sampler (`fraction_of_unmasked` = sample_us / sample_masked_us),
and of the mask's own traffic its bytes (the logits read and written once more, the bool mask
written and read) over the measured copy rate (`mask_fraction_of_copy_rate`, CUDA only).
Needs xgrammar (`pip install "zeroinfer[structured]"`).
"""

from __future__ import annotations

import json

import torch

from zeroinfer.sampling.sampler import SamplingBatch, sample
from zeroinfer.sampling_params import SamplingParams
from zeroinfer.structured_output import GrammarBackend, StructuredOutput
from zeroinfer.testing import bench
from zeroinfer.tokenizer import Tokenizer

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
# A few tokens into the object, so that the matchers sit in a string and at a key (the states
# whose masks are widest and narrowest).
PREFIXES = ['{"name": "Ad', '{"name": "Ada", "a', '{"name": "Ada", "age": 3']


def main() -> None:
    args = bench.parse_args(__doc__)
    cuda = args.device == "cuda"
    dev = torch.device("cuda" if cuda else "cpu")
    tok = Tokenizer()
    V = tok.vocab_size
    backend = GrammarBackend.shared(tok, V)
    spec = StructuredOutput(json=SCHEMA)
    ceilings = bench.measure_cuda_ceilings() if cuda else {}
    rows = []
    for R in (1, 8, 64):
        matchers = []
        for i in range(R):
            m = backend.matcher(spec)
            for t in tok.encode(PREFIXES[i % len(PREFIXES)], add_bos=False):
                assert m.accept_token(t)
            matchers.append(m)
        fill = bench.time_cpu(lambda: backend.token_bitmask(matchers), reps=20)
        mask = backend.token_bitmask(matchers)
        g = torch.Generator().manual_seed(R)
        logits = torch.randn(R, V, generator=g).to(dev)
        params = [SamplingParams(temperature=float(i % 2)) for i in range(R)]
        plain = SamplingBatch.build(params, list(range(R)), [5] * R, dev)
        masked = SamplingBatch.build(params, list(range(R)), [5] * R, dev, mask)
        if cuda:
            t_plain = bench.time_cuda(lambda: sample(logits, plain))
            t_masked = bench.time_cuda(lambda: sample(logits, masked))
        else:
            t_plain = bench.time_cpu(lambda: sample(logits, plain))
            t_masked = bench.time_cpu(lambda: sample(logits, masked))
        mask_bytes = R * V * (4 + 4 + 1 + 1)  # logits read + written, bool mask written + read
        row = {"rows": R, "vocab": V, "fill_us": fill * 1e6, "sample_us": t_plain * 1e6,
               "sample_masked_us": t_masked * 1e6, "fraction_of_unmasked": t_plain / t_masked,
               "mask_bytes": mask_bytes}
        if cuda:
            extra = max(t_masked - t_plain, 1e-9)
            row["mask_fraction_of_copy_rate"] = (mask_bytes / extra) / (
                ceilings["hbm_bytes_per_s"])
        rows.append(row)
        print(row, flush=True)
    cols = ["rows", "fill_us", "sample_us", "sample_masked_us", "fraction_of_unmasked"]
    bench.print_table(rows, cols + (["mask_fraction_of_copy_rate"] if cuda else []))
    path = bench.write_results("structured_output", rows, device=args.device,
                               extra={"schema": json.dumps(SCHEMA), "prefixes": PREFIXES,
                                      **({"ceilings": ceilings} if cuda else {})},
                               out_dir=args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
