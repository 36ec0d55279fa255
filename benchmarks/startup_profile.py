"""Where start-up goes: timestamped start-up log, then every Triton compilation it caused (kernel,
seconds, the specialisation that made it distinct), so cold start-up can be cut where it costs.

    TRITON_CACHE_DIR=$(mktemp -d) python3 -m benchmarks.startup_profile benchmarks/models/qwen3-0.6b [key=value ...]

An empty TRITON_CACHE_DIR gives a cold machine's start-up; the key=value pairs are engine options.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import logging
import pstats
import threading
import time


def record_compiles(records: list) -> bool:
    """Wrap Triton's per-kernel compile entry point; False when this Triton has none to wrap."""
    from triton.runtime.jit import JITFunction

    original = getattr(JITFunction, "_do_compile", None)
    if original is None:
        return False
    lock = threading.Lock()

    def timed(self, key, signature, device, constexprs, options, attrs, warmup):
        start = time.perf_counter()
        kernel = original(self, key, signature, device, constexprs, options, attrs, warmup)
        with lock:
            records.append((self.fn.__name__, time.perf_counter() - start, start, repr(constexprs)[:200],
                            repr(attrs)[:200]))
        return kernel

    JITFunction._do_compile = timed
    return True


class ThreadSampler:
    """Every ``interval`` seconds, the innermost frame of every other thread, so start-up time shows
    per thread (the main thread's phases and the background threads' work). A gap between samples
    much longer than ``interval`` means some thread held the GIL in native code all that while."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.samples: list[tuple[float, dict[str, str]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="sampler", daemon=True)

    def run(self) -> None:
        import sys

        names = {}
        while not self.stop.is_set():
            now = time.perf_counter()
            names.update({thread.ident: thread.name for thread in threading.enumerate()})
            frames = {}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, str(ident))
                if name == "sampler":
                    continue
                where, weir_where = frame, None
                while frame is not None and weir_where is None:
                    if frame.f_globals.get("__name__", "").startswith("weir."):
                        weir_where = frame
                    frame = frame.f_back
                frames[name] = (f"{where.f_code.co_filename.rsplit('/', 2)[-2:][-1]}:{where.f_code.co_name}"
                                + (f" <- weir {weir_where.f_code.co_name}" if weir_where else ""))
            self.samples.append((now, frames))
            time.sleep(self.interval)

    def report(self, start: float) -> None:
        """Per thread and per second: the commonest innermost frames; then the longest gaps."""
        by_second: dict[tuple[str, int], collections.Counter] = collections.defaultdict(collections.Counter)
        for at, frames in self.samples:
            for name, where in frames.items():
                by_second[(name, int(at - start))][where] += 1
        for (name, second), counter in sorted(by_second.items(), key=lambda item: (item[0][0], item[0][1])):
            top = ", ".join(f"{where} x{count}" for where, count in counter.most_common(3))
            print(f"  [{name[:18]:18s} {second:3d}s] {top}")
        gaps = sorted(((b[0] - a[0], a) for a, b in zip(self.samples, self.samples[1:])), key=lambda g: -g[0])
        for gap, (at, frames) in gaps[:12]:
            print(f"  gap {gap * 1000:6.0f} ms at {at - start:5.1f} s after: {frames}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print the N costliest calls (cumulative) of the start-up")
    parser.add_argument("--sample", type=float, default=0.0, metavar="MS",
                        help="sample every thread's innermost frame every MS milliseconds")
    parser.add_argument("options", nargs="*", help="engine options, key=value")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    begin = time.perf_counter()
    import torch  # noqa: F401  (timed: the import is part of every start-up)

    print(f"import torch: {time.perf_counter() - begin:.1f} s")
    records: list = []
    hooked = record_compiles(records)
    from weir import LLM

    options = {"load_format": "dummy", "max_model_len": 4096}
    for item in args.options:
        key, value = item.split("=", 1)
        # Engine options are type-checked: "true" is a bool and "0.8" a float, not strings.
        literals = {"true": True, "false": False}
        if value.lower() in literals:
            options[key] = literals[value.lower()]
        elif value.isdigit():
            options[key] = int(value)
        else:
            try:
                options[key] = float(value)
            except ValueError:
                options[key] = value
    profiler = cProfile.Profile() if args.cprofile else None
    start = time.perf_counter()
    sampler = ThreadSampler(args.sample / 1000) if args.sample else None
    if sampler:
        sampler.thread.start()
    if profiler:
        profiler.enable()
    LLM(args.model, **options)
    total = time.perf_counter() - start
    if sampler:
        sampler.stop.set()
        sampler.thread.join()
        sampler.report(start)
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.cprofile)
    print(f"STARTUP {total:.1f} s (LLM(...)); {time.perf_counter() - begin:.1f} s since the script began")
    if not hooked:
        print("this Triton has no JITFunction._do_compile: compile times not recorded")
        return
    compile_seconds = sum(seconds for _, seconds, *_ in records)
    print(f"{len(records)} Triton compilations, {compile_seconds:.1f} s in all")
    per_kernel = collections.defaultdict(list)
    for name, seconds, started, constexprs, attrs in records:
        per_kernel[name].append((seconds, started - start, constexprs, attrs))
    for name, runs in sorted(per_kernel.items(), key=lambda item: -sum(r[0] for r in item[1])):
        print(f"  {sum(r[0] for r in runs):6.2f} s  {len(runs):3d}x  {name}")
        if len(runs) > 1:
            for seconds, at, constexprs, attrs in runs:
                print(f"           {seconds:5.2f} s at {at:5.1f} s  {constexprs}  {attrs}")


if __name__ == "__main__":
    main()
