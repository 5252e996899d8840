"""Benchmark preprocessing against Megatron-LM's own tools/preprocess_data.py and the tokenizer-bound limit.

    python tools/bench/bench_preprocess.py --megatron-lm /tmp/megatron-lm --corpus man --vocab-size 8000 \\
        --workers 2 --repeats 5 --output results.json

1. Preprocessing, three commands on the same jsonl and SentencePiece BPE model (trained on the corpus):
   - ``megafp8``: ``tools/preprocess_data.py`` of this repository;
   - ``megatron-lm``: Megatron-LM's ``tools/preprocess_data.py`` run from the source tree given by
     ``--megatron-lm`` (that tree on PYTHONPATH, ``--tokenizer-type GPTSentencePieceTokenizer``). On Python
     3.11 its imports need ``typing.override``; the harness puts a ``sitecustomize.py`` that aliases
     ``typing_extensions.override`` into ``typing`` on that command's PYTHONPATH (nothing else changes);
   - ``limit``: SentencePiece's own batched, multi-threaded encode of the same documents, already in memory
     (``SentencePieceProcessor.encode(texts, num_threads=workers)``): no reading, parsing or writing, so no
     preprocessing tool can be faster with this tokenizer.
   Each command runs as a fresh process; wall seconds (the whole command, start-up included, except for
   ``limit``, which times only the encode call), CPU seconds (user + system of the process and its
   children), start-up seconds (the same command on the corpus's first document alone) and the share of
   the cores that other processes kept busy meanwhile (from /proc/stat) are recorded, min and median over ``--repeats``, rotating the order every repeat so background
   load on a shared machine hits all three alike. The megafp8 and Megatron-LM outputs are compared byte
   for byte. Without ``--megatron-lm`` only megafp8 and the limit run.
   Corpora: ``man`` (every page under /usr/share/man/man*, decompressed roff source, one document per page),
   ``stdlib`` (the embedded corpus of tools/build_corpus.py, ``--max-bytes``), ``paragraphs`` (stdlib
   docstrings cut at blank lines: ~120-byte documents, where per-document overhead dominates).

Index building is benchmarked by tools/bench/bench_data_index.py.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megafp8.data.corpus import build_corpus  # noqa: E402
from megafp8.data.tokenizer_training import train_sentencepiece  # noqa: E402

_TYPING_SHIM = (
    "# Benchmark harness only: Megatron-LM imports typing.override (Python >= 3.12).\n"
    "import typing\n\nimport typing_extensions\n\n"
    "if not hasattr(typing, 'override'):\n    typing.override = typing_extensions.override\n"
)


# --- corpora --------------------------------------------------------------------------------------------------

def man_pages_corpus(path: str) -> str:
    """One document per man page under /usr/share/man/man*/ (roff source, gz decompressed), sorted by path."""
    pages = sorted(p for p in glob.glob("/usr/share/man/man*/*") if os.path.isfile(p) and not os.path.islink(p))
    if not pages:
        raise SystemExit("--corpus man: no man pages under /usr/share/man/man*/ on this machine")
    with open(path, "w", encoding="utf-8") as out:
        for page in pages:
            with (gzip.open(page) if page.endswith(".gz") else open(page, "rb")) as f:
                text = f.read().decode("utf-8", errors="replace")
            if text.strip():
                out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    return path


def paragraph_corpus(workdir: str) -> str:
    """Short documents from real text: every paragraph of every stdlib docstring, one per line."""
    docstrings, path = os.path.join(workdir, "docstrings.jsonl"), os.path.join(workdir, "paragraphs.jsonl")
    build_corpus(docstrings, content="docstrings", progress=False)
    with open(docstrings, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        for line in f:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if paragraph.strip():
                    out.write(json.dumps({"text": paragraph}, ensure_ascii=False) + "\n")
    return path


def build_input(kind: str, workdir: str, max_bytes: int | None) -> str:
    if kind == "man":
        return man_pages_corpus(os.path.join(workdir, "man.jsonl"))
    if kind == "paragraphs":
        return paragraph_corpus(workdir)
    path = os.path.join(workdir, "stdlib.jsonl")
    build_corpus(path, max_bytes=max_bytes, progress=False)
    return path


# --- the three commands ---------------------------------------------------------------------------------------

def encode_limit(corpus: str, model: str, threads: int) -> None:
    """Child-process mode: time SentencePiece's batched encode of every document, already in memory."""
    import sentencepiece as spm

    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    sp = spm.SentencePieceProcessor(model_file=model)
    wall, cpu = time.perf_counter(), time.process_time()
    ids = sp.encode(texts, num_threads=threads)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "tokens": sum(map(len, ids)) + len(ids)}))  # + one EOD each


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (every process, from /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_idle_machine(max_wait_s: float, idle_fraction: float = 0.9, probe_s: float = 2.0) -> float:
    """Wait (at most max_wait_s) until other processes leave idle_fraction of the cores free; the busy share seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = _busy_cpu_seconds()
        time.sleep(probe_s)
        share = (_busy_cpu_seconds() - busy) / (probe_s * os.cpu_count())
        if share <= 1 - idle_fraction or time.monotonic() >= deadline:
            return share


def _run(command: list[str], env: dict | None = None) -> tuple[float, float, float, str]:
    """Run a command to completion; (wall s, user + system CPU s of it and its children, the share of the
    machine's cores that other processes kept busy meanwhile, stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy = _busy_cpu_seconds()
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    busy = _busy_cpu_seconds() - busy
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, max(busy - cpu, 0.0) / (wall * os.cpu_count()), result.stdout


def preprocess_commands(corpus: str, model: str, workdir: str, workers: int, megatron_lm: str | None) -> dict:
    """name -> (argv, env) of each command compared."""
    common = ["--input", corpus, "--json-keys", "text", "--tokenizer-model", model, "--append-eod",
              "--workers", str(workers)]
    commands = {
        "megafp8": ([sys.executable, os.path.join(REPO, "tools", "preprocess_data.py"), *common,
                     "--output-prefix", os.path.join(workdir, "megafp8"), "--tokenizer-type",
                     "SentencePieceTokenizer", "--no-progress-bar"], None),
        "limit": ([sys.executable, os.path.abspath(__file__), "--encode-limit", corpus, model, str(workers)], None),
    }
    if megatron_lm:
        shim = os.path.join(workdir, "typing_shim")
        os.makedirs(shim, exist_ok=True)
        with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
            f.write(_TYPING_SHIM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([shim, os.path.abspath(megatron_lm)])}
        commands["megatron-lm"] = ([sys.executable, os.path.join(megatron_lm, "tools", "preprocess_data.py"), *common,
                                    "--output-prefix", os.path.join(workdir, "megatron"), "--tokenizer-type",
                                    "GPTSentencePieceTokenizer"], env)
    return commands


def bench_preprocess(corpus: str, model: str, workdir: str, workers: int, repeats: int,
                     megatron_lm: str | None, wait_idle_s: float = 0.0) -> dict:
    commands = preprocess_commands(corpus, model, workdir, workers, megatron_lm)
    # The same commands on the corpus's first document alone (written elsewhere, so that the full runs'
    # outputs stay for the comparison) measure each tool's start-up: imports, pools.
    startup_dir = os.path.join(workdir, "startup")
    os.makedirs(startup_dir, exist_ok=True)
    one_document = os.path.join(startup_dir, "one_document.jsonl")
    with open(corpus, encoding="utf-8") as f, open(one_document, "w", encoding="utf-8") as out:
        out.write(f.readline())
    startup_commands = preprocess_commands(one_document, model, startup_dir, workers, megatron_lm)
    names = list(commands)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:  # rotate the order
            argv, env = commands[name]
            if wait_idle_s:
                wait_for_idle_machine(wait_idle_s)
            wall, cpu, others, stdout = _run(argv, env)
            if name == "limit":  # the child timed only its encode call
                wall, cpu = json.loads(stdout)["wall_s"], json.loads(stdout)["cpu_s"]
                startup = 0.0
            else:
                startup = _run(*startup_commands[name])[0]
            runs[name].append({"wall_s": wall, "cpu_s": cpu, "startup_s": startup, "others_busy": others,
                               "loadavg": os.getloadavg()[0]})
            print(json.dumps({"repeat": repeat, "command": name, **runs[name][-1]}), flush=True)
    row = {"corpus_mb": os.path.getsize(corpus) / 1e6, "workers": workers, "repeats": repeats,
           "commands": {name: " ".join(argv) for name, (argv, _) in commands.items()}, "runs": runs}
    for name in names:
        for metric in ("wall_s", "cpu_s", "startup_s", "others_busy"):
            values = [r[metric] for r in runs[name]]
            row[f"{name}_{metric}_min"], row[f"{name}_{metric}_median"] = min(values), statistics.median(values)
        # Runs during which other processes kept under 10% of the cores busy: the numbers of a quiet machine.
        quiet = [r["wall_s"] for r in runs[name] if r["others_busy"] < 0.1]
        if quiet:
            row[f"{name}_quiet_runs"], row[f"{name}_quiet_wall_s_min"] = len(quiet), min(quiet)
            row[f"{name}_quiet_wall_s_median"] = statistics.median(quiet)
    for stat in ("min", "median"):
        row[f"megafp8_over_limit_wall_{stat}"] = row[f"megafp8_wall_s_{stat}"] / row[f"limit_wall_s_{stat}"]
        if megatron_lm:
            row[f"megatron_over_megafp8_wall_{stat}"] = row[f"megatron-lm_wall_s_{stat}"] / row[f"megafp8_wall_s_{stat}"]
    if megatron_lm:
        for ext in (".bin", ".idx"):
            with open(os.path.join(workdir, f"megafp8_text_document{ext}"), "rb") as f, \
                    open(os.path.join(workdir, f"megatron_text_document{ext}"), "rb") as g:
                row[f"identical{ext}"] = f.read() == g.read()
    from megafp8.data.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(os.path.join(workdir, "megafp8_text_document"))
    row.update(documents=len(dataset), tokens=dataset.num_tokens)
    print(json.dumps({k: v for k, v in row.items() if k not in ("runs", "commands")}), flush=True)
    return row


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--encode-limit":
        encode_limit(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="/tmp/megafp8_bench_preprocess")
    parser.add_argument("--megatron-lm", default=None, help="a Megatron-LM source tree (NVIDIA/Megatron-LM)")
    parser.add_argument("--corpus", choices=("man", "stdlib", "paragraphs"), default="man")
    parser.add_argument("--max-bytes", type=int, default=None, help="stdlib corpus size (default: all of it)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wait-idle", type=float, default=0.0,
                        help="before each command wait up to this many seconds for a machine 90%% idle")
    parser.add_argument("--output", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
               "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
               "command": " ".join(sys.argv), "loadavg_before": os.getloadavg(),
               "sentencepiece": __import__("sentencepiece").__version__}
    corpus = build_input(args.corpus, args.workdir, args.max_bytes)
    model = train_sentencepiece([corpus], os.path.join(args.workdir, f"sp{args.vocab_size}"), args.vocab_size,
                                max_sentences=300_000, progress=False)
    results["preprocess"] = bench_preprocess(corpus, model, args.workdir, args.workers, args.repeats,
                                             args.megatron_lm, args.wait_idle)
    results["preprocess"].update(corpus=args.corpus, vocab_size=args.vocab_size)
    results["loadavg_after"] = os.getloadavg()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
