"""What proving a Hugging Face family's cut costs at construction, and which families pass.

``CausalLM`` proves its cut of each configuration before training (``lightning_async_pp.models.hf_structure``):
it builds a small copy of the configuration on the CPU and compares the pipeline layers' logits with
``transformers``' own. This script builds ``CausalLM`` from each family's default configuration (the
full-size shapes of a real checkpoint, on the meta device), twice: the first construction proves the cut, the
second finds the verdict kept in the process. It records, per family, the whole first construction, the proof
within it, the second construction, and the refusal when there is one; and saves the table as JSON.

    python benchmarks/hf_proof.py [--out benchmarks/results/hf_proof/hf_proof.json]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import machine_description, save_report  # noqa: E402

FAMILIES = (
    "llama gpt2 mistral qwen2 qwen3 gemma gemma2 gemma3_text phi3 olmo2 olmo olmo3 phi starcoder2 granite cohere "
    "cohere2 stablelm smollm3 glm glm4 helium exaone4 ernie4_5 arcee apertus seed_oss hunyuan_v1_dense ministral "
    "ministral3 gpt_neox "
    "gpt_bigcode persimmon gptj codegen falcon mpt bloom xglm opt biogpt nemotron"
).split()
EAGER = {"gemma2", "bloom", "mpt", "xglm"}  # transformers refuses sdpa for these
# Their default configurations do not build in transformers 5.24 (head_dim None); Mistral-7B's head size.
SETTINGS = {"ministral": dict(head_dim=128), "hunyuan_v1_dense": dict(head_dim=128)}


def measure(family: str) -> dict:
    from lightning_async_pp.models import CausalLM

    attn = "eager" if family in EAGER else "sdpa"
    row: dict = {"family": family, "attn_implementation": attn}
    start = time.perf_counter()
    try:
        model = CausalLM(model_type=family, config=SETTINGS.get(family, {}), attn_implementation=attn)
    except Exception as error:  # a refusal, or transformers' own failure to build the default configuration
        row.update(accepted=False, refusal=f"{type(error).__name__}: {error}")
        return row
    row.update(accepted=True, construct_s=time.perf_counter() - start, proof_s=model.proof_seconds)
    start = time.perf_counter()
    again = CausalLM(model_type=family, config=SETTINGS.get(family, {}), attn_implementation=attn)
    row.update(construct_again_s=time.perf_counter() - start, proof_again_s=again.proof_seconds)
    row["parameters_full_size"] = sum(p.numel() for p in model.parameters())
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    from lightning_async_pp.models import CausalLM

    # The first proof of a process also pays torch's and transformers' first-call costs: recorded apart.
    first = CausalLM(model_type="llama", config=dict(vocab_size=100)).proof_seconds
    rows = [measure(f) for f in args.families.split(",")]
    print(f"{'family':>18} {'construct s':>12} {'proof s':>8} {'again s':>8}  refusal")
    for r in rows:
        if r["accepted"]:
            print(f"{r['family']:>18} {r['construct_s']:>12.3f} {r['proof_s']:>8.3f} {r['construct_again_s']:>8.3f}")
        else:
            print(f"{r['family']:>18} {'-':>12} {'-':>8} {'-':>8}  {r['refusal'][:110]}")
    print(f"first proof of the process (llama, vocab 100): {first:.3f} s")
    save_report({"machine": machine_description(), "threads": 1, "first_proof_s": first, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
