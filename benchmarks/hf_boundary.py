"""Send or recompute? What a Hugging Face decoder layer needs besides the hidden states, measured.

At a stage boundary of a Llama-shaped model the next layer needs the hidden states, the attention mask and
the rotary (cos, sin) tables. This script prints, for a few sequence lengths, the bytes each would add to a
message and the time a layer takes to rebuild the mask and the tables from the micro-batch (what
``lightning_async_pp.models.CausalLM``'s stages do once per micro-batch), and saves the table as JSON.

    python benchmarks/hf_boundary.py [--out benchmarks/results/hf_boundary/hf_boundary.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import machine_description  # noqa: E402


def measure(seq: int, hidden: int, heads: int, batch: int, repeats: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from lightning_async_pp.models.hf_layers import BatchContext, DecoderLayer

    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=seq,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    rotary = type(model.model.rotary_emb)(config=model.config)
    layer = DecoderLayer(torch.nn.Identity(), rotary, model.config, "full_attention")
    hidden_states = torch.zeros(batch, seq, 1, dtype=torch.bfloat16).expand(batch, seq, hidden)
    padding = torch.ones(batch, seq, dtype=torch.long)
    padding[:, : seq // 8] = 0
    dense, padded = {"input_ids": None}, {"input_ids": None, "attention_mask": padding}

    def rebuild(batch_dict) -> tuple:
        # What a stage does once per micro-batch: a fresh context, as for a micro-batch it has not seen.
        mask, _, rotary = BatchContext().get(layer, hidden_states, batch_dict)
        return mask, rotary

    def seconds(batch_dict) -> float:
        rebuild(batch_dict)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            rebuild(batch_dict)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    mask, (cos, sin) = rebuild(padded)
    return {
        "seq": seq,
        "batch": batch,
        "hidden": hidden,
        "hidden_states_MiB": batch * seq * hidden * 2 / 2**20,
        "padding_mask_MiB": mask.numel() * mask.element_size() / 2**20,
        "rotary_MiB": (cos.numel() * cos.element_size() + sin.numel() * sin.element_size()) / 2**20,
        "rebuild_ms_dense": seconds(dense) * 1e3,
        "rebuild_ms_padded": seconds(padded) * 1e3,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="512,2048,4096")
    parser.add_argument("--hidden", type=int, default=4096, help="Llama-3-8B: 4096")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(int(s), args.hidden, args.heads, args.batch, args.repeats) for s in args.seqs.split(",")]
    print(f"{'seq':>6} {'hidden MiB':>11} {'mask MiB':>9} {'rotary MiB':>11} {'rebuild ms':>11} {'padded ms':>10}")
    for r in rows:
        print(
            f"{r['seq']:>6} {r['hidden_states_MiB']:>11.1f} {r['padding_mask_MiB']:>9.1f} {r['rotary_MiB']:>11.2f} "
            f"{r['rebuild_ms_dense']:>11.3f} {r['rebuild_ms_padded']:>10.3f}"
        )
    report = {"machine": machine_description(), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    else:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
