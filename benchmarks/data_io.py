"""Data throughput: ``kforge prepare-data`` at 1 and N workers next to the tokenizer's own limit and datasets.map,
and the training loaders' tokens/s per rank next to what an 8B step consumes.

What it measures
----------------
The text is tiny-shakespeare's paragraphs (bundled), repeated to ``--mb`` MB, one jsonl record each. Every variant
runs in a fresh subprocess (so no tokenizer thread pool or cache carries over) and reports its wall seconds and the
CPU seconds of its process and all its children (``getrusage``) over the timed part only (imports excluded):

- ``encode_batch``: the GPT-2 tokenizer's ``Tokenizer.encode_batch`` on the records already in memory, 1,024 per
  call, on N Rayon threads (``RAYON_NUM_THREADS``): the physical limit on these cores. ``encode_batch_1``: one thread.
- ``prepare``: ``prepare_data`` of the jsonl file into shards of ``--shard-bytes`` (512 KiB: 32 shards of the 16 MB,
  so the last shard's tail leaves a worker idle for about 1/32 of the run), with ``num_workers`` 1 and N
  (reading, JSON parsing, tokenizing, writing and fsyncing every shard, the metadata).
- ``datasets_map``: ``datasets.load_dataset("json")`` of the same file (cache in a temporary folder) and
  ``Dataset.map(batched=True, batch_size=1024, num_proc=N)`` with the same tokenizer, one thread per process.

Each variant runs ``--repeats`` times, round-robin; the wall figures are the best run's (shortest wall), and
``paired_wall_ratios`` the median over rounds of each round's own ratio (runs of one round see about the same load).
On a shared
machine they move with the other load; tokens per CPU-second of the whole run (median over the repeats) do not
count waiting, so ``cpu_ratios`` compare the work each variant does for the same tokens, and
``idle_speedup_bound`` (N x N workers' tokens per CPU-second / one worker's) is the speed-up an idle machine gives
when every worker is busy all the time. ``load_avg`` is ``os.getloadavg()`` before each run; ``--max-load`` waits
for a quieter machine before each round.

The loaders: the 8B recipe's shape (``configs/llama3_8b.yaml``: seq_len, micro_batch_size, num_workers) on one rank:
``TokenDataModule`` over a memmap folder of random uint32 ids (vocab 128,256) and ``StreamingTokenDataModule``
tokenizing the jsonl on the fly (GPT-2's tokenizer: the Llama 3 one is not bundled; its cost per byte is alike).
Tokens/s per rank is measured after ``--loader-warmup`` batches. The step's consumption per GPU is estimated, not
measured: the recipe's training FLOPs per token (``ModelConfig.flops_per_token``, PaLM's 6N + 12 L d s) at
``--mfu`` (default 0.40, what torchtitan reports for Llama-3-8B on H100s) of ``--peak-tflops`` (989, an H100 SXM's
dense bf16 peak).

    python benchmarks/data_io.py --json benchmarks/results/data_io_2core.json
    python benchmarks/data_io.py --mb 0.3 --shard-bytes 65536 --repeats 1 --loader-seq 256 --json /tmp/d.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizers" / "gpt2"
SHAKESPEARE = REPO / "data" / "tinyshakespeare" / "input.txt"
BATCH = 1024
TARGETS = {"speedup_vs_1_worker": 1.8, "vs_encode_batch": 0.9, "vs_datasets_map": 1.0}


def write_corpus(path: Path, mb: float) -> int:
    """Tiny-shakespeare paragraphs repeated to ``mb`` MB of jsonl records; returns the record count."""
    paragraphs = [p for p in SHAKESPEARE.read_text().split("\n\n") if p.strip()]
    lines, size = [], 0
    while size < mb * 1e6:
        for p in paragraphs:
            line = json.dumps({"text": p}) + "\n"
            lines.append(line)
            size += len(line)
            if size >= mb * 1e6:
                break
    path.write_text("".join(lines))
    return len(lines)


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# -- one variant, in its own process ------------------------------------------------------------------------------------


def run_variant(name: str, workers: int, corpus: Path, work: Path, shard_bytes: int) -> dict:
    """Times one variant in this process (see the module docstring); returns tokens, wall_s, cpu_s."""
    if name.startswith("encode_batch"):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
        docs = [json.loads(line)["text"] for line in corpus.open()]
        start, cpu = time.perf_counter(), _cpu()
        tokens = 0
        for i in range(0, len(docs), BATCH):
            tokens += sum(len(e.ids) for e in tok.encode_batch(docs[i : i + BATCH], add_special_tokens=False))
        tokens += len(docs)  # prepare-data's EOS per document, so the counts compare
    elif name == "prepare":
        from kempnerforge.data.prepare import prepare_data

        start, cpu = time.perf_counter(), _cpu()
        meta = prepare_data(str(corpus), str(TOKENIZER), str(work / "out"), progress=False, num_workers=workers,
                            shard_bytes=shard_bytes)  # fmt: skip
        tokens = meta["num_tokens"]
    elif name == "datasets_map":
        import datasets
        from tokenizers import Tokenizer

        datasets.disable_progress_bars()
        tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))

        def encode(batch: dict) -> dict:
            return {"input_ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

        start, cpu = time.perf_counter(), _cpu()
        ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(work / "hf"))
        out = ds.map(encode, batched=True, batch_size=BATCH, num_proc=workers, remove_columns=["text"])
        tokens = sum(len(ids) for ids in out["input_ids"]) + len(out)
    else:
        raise ValueError(f"unknown variant {name!r}")
    return {"tokens": int(tokens), "wall_s": time.perf_counter() - start, "cpu_s": _cpu() - cpu}


def spawn_variant(name: str, workers: int, corpus: Path, shard_bytes: int) -> dict:
    """:func:`run_variant` in a fresh interpreter (threads per the variant), with the load average before it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if name == "encode_batch":
        env.update(TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(workers))
    else:
        env.update(TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as work:
        cmd = [sys.executable, __file__, "--variant", name, "--workers", str(workers), "--corpus", str(corpus),
               "--work", work, "--shard-bytes", str(shard_bytes)]  # fmt: skip
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} x{workers} failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result, "load_avg": round(load, 2), "tokens_per_s": result["tokens"] / result["wall_s"],
            "tokens_per_cpu_s": result["tokens"] / result["cpu_s"]}  # fmt: skip


def wait_for_quiet(max_load: float | None, max_wait_s: float) -> None:
    """Waits (at most ``max_wait_s``) until the 1-minute load average is below ``max_load`` (None: no wait)."""
    deadline = time.monotonic() + max_wait_s
    while max_load is not None and os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5)


def tokenize_section(
    mb: float, workers: int, shard_bytes: int, repeats: int, root: Path, max_load: float | None = None,
    max_wait_s: float = 0.0,
) -> dict:  # fmt: skip
    """Every tokenizing variant, ``repeats`` rounds; the best (shortest wall) run of each and the ratios."""
    corpus = root / "corpus.jsonl"
    records = write_corpus(corpus, mb)
    plan = [("encode_batch_1", 1), ("encode_batch", workers), ("prepare", 1), ("prepare", workers),
            ("datasets_map", workers)]  # fmt: skip
    runs: dict[str, list[dict]] = {f"{n}@{w}": [] for n, w in plan}
    for _ in range(repeats):
        wait_for_quiet(max_load, max_wait_s)
        for name, w in plan:
            runs[f"{name}@{w}"].append(spawn_variant(name, w, corpus, shard_bytes))
    best = {key: min(rs, key=lambda r: r["wall_s"]) for key, rs in runs.items()}
    per_cpu = {key: statistics.median(r["tokens_per_cpu_s"] for r in rs) for key, rs in runs.items()}
    pairs = {  # ratio name -> (numerator, denominator) variants
        "speedup_vs_1_worker": (f"prepare@{workers}", "prepare@1"),
        "vs_encode_batch": (f"prepare@{workers}", f"encode_batch@{workers}"),
        "vs_datasets_map": (f"prepare@{workers}", f"datasets_map@{workers}"),
        "one_worker_vs_encode_batch_1": ("prepare@1", "encode_batch_1@1"),
    }
    ratios = {k: best[a]["tokens_per_s"] / best[b]["tokens_per_s"] for k, (a, b) in pairs.items()}
    # The same ratio within each round (the runs minutes apart see about the same load), median over the rounds.
    paired = {
        k: statistics.median(x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b], strict=True))
        for k, (a, b) in pairs.items()
    }
    mine = per_cpu[f"prepare@{workers}"]
    cpu = {
        "cpu_efficiency": mine / per_cpu["prepare@1"],
        "vs_encode_batch": mine / per_cpu[f"encode_batch@{workers}"],
        "vs_datasets_map": mine / per_cpu[f"datasets_map@{workers}"],
        "idle_speedup_bound": workers * mine / per_cpu["prepare@1"],
    }
    tokens = {r["tokens"] for r in best.values()}
    return {
        "corpus_mb": round(corpus.stat().st_size / 1e6, 3), "records": records, "workers": workers,
        "shard_bytes": shard_bytes, "repeats": repeats, "tokens": sorted(tokens), "best": best, "runs": runs,
        "median_tokens_per_cpu_s": per_cpu, "wall_ratios": ratios, "paired_wall_ratios": paired, "cpu_ratios": cpu,
        "targets": TARGETS, "pass_wall": {k: ratios[k] >= v for k, v in TARGETS.items()},
        "pass_paired_wall": {k: paired[k] >= v for k, v in TARGETS.items()},
    }  # fmt: skip


# -- the training loaders -----------------------------------------------------------------------------------------------


def loader_section(root: Path, seq_len: int | None, batches: int, warmup: int, mfu: float, peak_tflops: float) -> dict:
    """Tokens/s per rank of the memmap and streaming loaders at the 8B recipe's shape, and the step's consumption."""
    import numpy as np
    import yaml

    from kempnerforge.config.model import ModelConfig
    from kempnerforge.data.datamodule import TokenDataModule
    from kempnerforge.data.streaming import StreamingTokenDataModule

    recipe = yaml.safe_load((REPO / "configs" / "llama3_8b.yaml").read_text())
    data, model = recipe["data"], ModelConfig(**recipe["model"]["config"])
    seq = seq_len or data["seq_len"]
    mbs, workers = data["micro_batch_size"], data["num_workers"]
    tokens_per_step = mbs * data["seq_len"]  # per rank, at the recipe's own shape
    flops = model.flops_per_token(data["seq_len"])
    consumed = mfu * peak_tflops * 1e12 / flops  # tokens/s per GPU
    needed = (batches + warmup + 2) * mbs * (seq + 1)
    folder = root / "tokens"
    folder.mkdir()
    ids = np.random.default_rng(0).integers(0, model.vocab_size, needed, dtype=np.uint32)
    np.save(folder / "shard_00000.npy", ids)
    meta = {"vocab_size": model.vocab_size, "dtype": "uint32", "num_tokens": needed,
            "shards": [{"file": "shard_00000.npy", "num_tokens": needed, "max_token_id": int(ids.max())}]}  # fmt: skip
    (folder / "metadata.json").write_text(json.dumps(meta))
    memmap = TokenDataModule(str(folder), seq_len=seq, micro_batch_size=mbs, val_fraction=0.0, num_workers=workers)
    stream = StreamingTokenDataModule(str(root / "corpus.jsonl"), str(TOKENIZER), seq_len=seq, micro_batch_size=mbs,
                                      num_workers=workers)  # fmt: skip
    rows = {}
    for name, dm in (("memmap", memmap), ("streaming", stream)):
        loader = dm.train_dataloader()
        it = iter(loader)
        for _ in range(warmup):
            next(it)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        rate = batches * mbs * seq / (time.perf_counter() - start)
        rows[name] = {"tokens_per_s_per_rank": rate, "vs_step_consumption": rate / consumed}
        del it, loader
    return {
        "recipe": "configs/llama3_8b.yaml", "seq_len": seq, "recipe_seq_len": data["seq_len"], "micro_batch_size": mbs,
        "num_workers": workers, "tokens_per_step_per_rank": tokens_per_step, "flops_per_token": flops, "mfu": mfu,
        "peak_tflops": peak_tflops, "step_s_estimate": tokens_per_step / consumed,
        "consumed_tokens_per_s_per_gpu": consumed, "batches": batches, "loaders": rows,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=16.0, help="MB of jsonl text")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="N (default: the CPUs)")
    parser.add_argument("--shard-bytes", type=int, default=1 << 19, help="prepare-data's shard_bytes")
    parser.add_argument("--max-load", type=float, default=None, help="start each round below this 1-min load")
    parser.add_argument("--max-wait-s", type=float, default=600.0, help="longest wait for --max-load per round")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loader-seq", type=int, default=None, help="seq_len of the loaders (default: the recipe's)")
    parser.add_argument("--loader-batches", type=int, default=20)
    parser.add_argument("--loader-warmup", type=int, default=3)
    parser.add_argument("--mfu", type=float, default=0.40)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:  # a child: one timed variant, its result as the last line
        print(json.dumps(run_variant(args.variant, args.workers, args.corpus, args.work, args.shard_bytes)))
        return None
    root = Path(tempfile.mkdtemp(prefix="data_io_"))
    try:
        result = {"machine": {"cpus": len(os.sched_getaffinity(0)), "load_avg_start": os.getloadavg()}}
        result["tokenize"] = tokenize_section(
            args.mb, args.workers, args.shard_bytes, args.repeats, root, args.max_load, args.max_wait_s
        )
        result["loader"] = loader_section(root, args.loader_seq, args.loader_batches, args.loader_warmup, args.mfu,
                                          args.peak_tflops)  # fmt: skip
        result["machine"]["load_avg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


def _print(result: dict) -> None:
    t = result["tokenize"]
    print(f"{t['corpus_mb']} MB jsonl, {t['tokens'][0]:,} tokens, N={t['workers']}, best of {t['repeats']}")
    print(f"{'variant':<18}{'tokens/s':>12}{'tokens/cpu-s':>14}{'wall s':>8}{'cpu s':>8}{'load':>6}")
    for key, r in t["best"].items():
        print(f"{key:<18}{r['tokens_per_s']:>12,.0f}{r['tokens_per_cpu_s']:>14,.0f}{r['wall_s']:>8.2f}"
              f"{r['cpu_s']:>8.2f}{r['load_avg']:>6.1f}")  # fmt: skip
    for k, v in t["wall_ratios"].items():
        target = TARGETS.get(k)
        verdict = f" (target >= {target}: {'pass' if v >= target else 'FAIL'})" if target else ""
        print(f"  wall {k}: best runs {v:.2f}, paired median {t['paired_wall_ratios'][k]:.2f}{verdict}")
    for k, v in t["cpu_ratios"].items():
        print(f"  per CPU-second (median) {k}: {v:.2f}")
    ld = result["loader"]
    print(f"8B recipe per rank: {ld['tokens_per_step_per_rank']:,} tokens/step (seq {ld['seq_len']}), consumes "
          f"{ld['consumed_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU at {ld['mfu']:.0%} MFU of "
          f"{ld['peak_tflops']:.0f} TFLOP/s ({ld['flops_per_token'] / 1e9:.1f} GFLOP/token)")  # fmt: skip
    for name, row in ld["loaders"].items():
        print(f"  {name} loader: {row['tokens_per_s_per_rank']:,.0f} tokens/s per rank = "
              f"{row['vs_step_consumption']:.1f}x the step's consumption")  # fmt: skip


if __name__ == "__main__":
    main()
