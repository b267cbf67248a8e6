"""Load on `hf-blockdiff serve`: `python benchmarks/serve_load.py [--shape sdar-4b | --model DIR] [--clients 128]
[--client-processes 4] [--min-prompt 64] [--max-prompt 512] [--new-tokens 256] [--rounds 2] [--device cuda]
[--dtype bfloat16]` serves the model in this process (uvicorn in a thread over a LiveEngine of --clients slots);
--client-processes processes of their own, as a server's clients are, send --clients concurrent streamed completions
of random prompts of mixed lengths between them (no stop token: every row runs --new-tokens), once to warm up and
--rounds times timed, each round begun by every process at once (a round can still meet chunk counts, so graphs, that
the ones before did not), then decodes the same prompts offline with `generate_multi_block` at batch --clients (also
warmed up). One process of 128 asyncio clients is a load generator of its own limits: parsing 128 event streams took
it 2.5-3.4 s of CPU in a 4.7 s round, and its first request reached the server 150-500 ms after it began
(docs/benchmarks.md, "Serving under load"). Prints a table and one JSON line: served tokens/s of each timed round and
their median, offline tokens/s and the ratios, the last round's p50/p99 time to the first committed token and per
request, and how many served completions differ from the offline batch's row of the same prompt (`--batch-invariant`:
decode with RuntimeOptions.batch_invariant, under which none may; without it the count is only reported); per round,
where the server's time went (serve_timeline.py: when requests arrived and rows were submitted, the engine's steps and
the time between them, thread wake-up lag, garbage collections) and the clients' CPU time. Random weights have no
tokenizer: the server decodes ids with a stand-in one character per id, which maps its text back to ids."""

import argparse
import asyncio
import json
import multiprocessing
import statistics
import threading
import time

import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation.live import LiveEngine
from hf_blockdiff.integrations.completions import left_padded
from hf_blockdiff.serve.admission import Limits
from hf_blockdiff.serve.app import Server, create_app
from hf_blockdiff.tools.bench_models import build_model, prompt_ceiling
from serve_timeline import Collections, StepTimeline, percentile


class IdTokenizer:
    """Text for random weights: one character per id (the server's detokenizing at about a real one's cost), past the
    surrogates, so the text maps back to the ids."""

    FIRST = 0x10000

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(self.FIRST + token) for token in ids)

    def ids(self, text: str) -> list[int]:
        return [ord(character) - self.FIRST for character in text]


def random_prompts(model, count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    top = prompt_ceiling(model)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, top, (n,), generator=generator).tolist() for n in lengths]


def serve_in_thread(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


async def one_request(client, url: str, prompt: list[int], new_tokens: int) -> dict:
    body = {"model": "load", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    began, first, tokens, text = time.perf_counter(), None, 0, ""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and any(choice.get("text") for choice in chunk["choices"]):
                first = time.perf_counter() - began
            text += "".join(choice.get("text", "") for choice in chunk["choices"])
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
    return {"ttft_s": first, "seconds": time.perf_counter() - began, "tokens": tokens, "text": text}


async def load(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[list[dict], float, tuple, float]:
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(prompts)), timeout=None) as client:
        began, wall, cpu = time.perf_counter(), time.time(), time.process_time()
        results = await asyncio.gather(*(one_request(client, url, p, new_tokens) for p in prompts))
        return results, time.perf_counter() - began, (wall, time.time()), time.process_time() - cpu


def clients(url: str, prompts: list[list[int]], new_tokens: int, rounds: int, start, results) -> None:
    """One clients' process: a warm-up round (the server compiles and captures), then the timed ones, each begun with
    the other processes' (`start`, a barrier), sent back."""
    start.wait()
    asyncio.run(load(url, prompts, new_tokens))
    timed = []
    for _ in range(rounds):
        start.wait()
        timed.append(asyncio.run(load(url, prompts, new_tokens)))
    results.send(timed)


def served(url: str, prompts: list[list[int]], new_tokens: int, rounds: int,
           processes: int) -> list[tuple[list[dict], float, tuple, list[float]]]:
    """The timed rounds of `clients` in `processes` spawned processes, each sending its share of the prompts (the
    clients' JSON and HTTP work takes no GIL time from the server's threads, and one process's event loop does not
    pace them all): per round the results in prompt order, its wall-clock seconds and span from the first request
    sent to the last answer, and each process's CPU seconds."""
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(processes)
    shares = [list(range(len(prompts)))[i::processes] for i in range(processes)]
    pipes, workers = [], []
    for share in shares:
        receive, send = context.Pipe(duplex=False)
        workers.append(context.Process(target=clients, daemon=True, args=(
            url, [prompts[i] for i in share], new_tokens, rounds, start, send)))
        workers[-1].start()
        send.close()  # the process holds its own end: its pipe reads as ended once it exits
        pipes.append(receive)
    try:
        received = {}
        while len(received) < processes:  # in whatever order they finish: one that ended leaves the others waiting
            for index, receive in enumerate(pipes):
                if index not in received and receive.poll(0.2):
                    try:
                        received[index] = receive.recv()
                    except EOFError:
                        workers[index].join(10)
                        raise RuntimeError(f"a clients' process ended (exit code {workers[index].exitcode}) without "
                                           "results") from None
    finally:
        for worker in workers:
            worker.join(10)
            worker.kill()
    received = [received[index] for index in range(processes)]
    return [merged([timed[r] for timed in received], shares, len(prompts)) for r in range(rounds)]


def merged(parts: list[tuple], shares: list[list[int]], count: int) -> tuple[list[dict], float, tuple, list[float]]:
    results = [None] * count
    for (part, _, _, _), share in zip(parts, shares):
        for i, result in zip(share, part):
            results[i] = result
    span = (min(p[2][0] for p in parts), max(p[2][1] for p in parts))
    return results, span[1] - span[0], span, [p[3] for p in parts]


def offline(model, prompts: list[list[int]], cfg: BlockDiffusionConfig) -> tuple[int, float, list[list[int]]]:
    """(tokens committed, seconds, each row's generated ids)."""
    ids, mask = left_padded(prompts, 0, model.device)
    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    synchronize()
    began = time.perf_counter()
    out = model.generate_multi_block(ids, cfg, attention_mask=mask, return_dict=True)
    synchronize()
    seconds = time.perf_counter() - began
    rows = [row[step >= 0].tolist() for row, step in zip(out.sequences[:, ids.shape[1]:].cpu(), out.commit_step.cpu())]
    return int((out.commit_step >= 0).sum()), seconds, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("clients", 128), ("min-prompt", 64), ("max-prompt", 512), ("new-tokens", 256),
                          ("rounds", 2), ("client-processes", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--shape", default="sdar-4b")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: random weights of --shape)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-invariant", action="store_true",
                        help="serve and decode offline with RuntimeOptions.batch_invariant: served must equal offline")
    args = parser.parse_args()
    model = build_model(args.shape, args.model, args.device, getattr(torch, args.dtype))
    cfg = BlockDiffusionConfig(max_new_tokens=args.new_tokens, eos_token_id=[], batch_invariant=args.batch_invariant)
    prompts = random_prompts(model, args.clients, args.min_prompt, args.max_prompt)
    engine = LiveEngine(model, cfg, max_batch_size=args.clients, max_prompt_tokens=args.max_prompt,
                        max_new_tokens=args.new_tokens)
    limits = Limits(args.max_prompt, args.new_tokens)
    tokenizer = IdTokenizer()
    collections, timeline = Collections(), StepTimeline(engine)
    app = create_app(Server(engine, tokenizer, "load", limits, max_queue=args.clients, request_timeout=3600,
                            warm_up=True))
    server, thread, url = serve_in_thread(timeline.serving(app))
    try:
        rounds = served(url, prompts, args.new_tokens, args.rounds, args.client_processes)
    finally:
        server.should_exit = True
        thread.join()
    offline(model, prompts, cfg)  # warm-up
    offline_tokens, offline_s, rows = offline(model, prompts, cfg)
    differing = sum(tokenizer.ids(result["text"]) != row
                    for results, _, _, _ in rounds for result, row in zip(results, rows))
    spans = [span for _, _, span, _ in rounds]
    report(args, rounds, offline_tokens, offline_s, differing, [collections.within(span) for span in spans],
           [timeline.within(span) for span in spans])


def report(args, rounds: list[tuple[list[dict], float, tuple, list[float]]], offline_tokens: int, offline_s: float,
           differing: int, pauses: list[tuple[float, int]], steps: list[dict]) -> None:
    each = [sum(r["tokens"] for r in results) / seconds for results, seconds, _, _ in rounds]
    results, served_tok_s = rounds[-1][0], statistics.median(each)
    offline_tok_s = offline_tokens / offline_s
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    latency = [r["seconds"] for r in results]
    summary = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "shape": args.model or args.shape, "clients": args.clients, "prompt_tokens": [args.min_prompt,
               args.max_prompt], "new_tokens": args.new_tokens, "served_tok_s": round(served_tok_s, 1),
               "offline_tok_s": round(offline_tok_s, 1), "served_tok_s_each_round": [round(x, 1) for x in each],
               "served_over_offline_each_round": [round(x / offline_tok_s, 3) for x in each],
               "served_over_offline": round(served_tok_s / offline_tok_s, 3),
               "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_p99_s": round(percentile(ttft, 99), 3),
               "request_p50_s": round(statistics.median(latency), 3),
               "request_p99_s": round(percentile(latency, 99), 3), "batch_invariant": args.batch_invariant,
               "rows_differing_from_offline": differing,
               "gc_pause_s_each_round": [round(seconds, 3) for seconds, _ in pauses],
               "gc_oldest_generation_each_round": [count for _, count in pauses], "engine_each_round": steps,
               "client_processes": args.client_processes,
               "client_cpu_s_each_round": [[round(cpu, 2) for cpu in each] for _, _, _, each in rounds]}
    ratios = ", ".join(map(str, summary["served_over_offline_each_round"]))
    print(f"tokens/s                 served {', '.join(f'{x:.1f}' for x in each)} (rounds), offline "
          f"{offline_tok_s:.1f} (served / offline {ratios}; median {summary['served_over_offline']:.3f})")
    print(f"first committed token    p50 {summary['ttft_p50_s']:.3f} s, p99 {summary['ttft_p99_s']:.3f} s")
    print(f"request                  p50 {summary['request_p50_s']:.3f} s, p99 {summary['request_p99_s']:.3f} s")
    print("garbage collection       " + ", ".join(f"{seconds:.3f} s ({count} of the oldest generation)"
                                                  for seconds, count in pauses) + " (rounds, server process)")
    for i, one in enumerate(steps):
        print(f"engine, round {i + 1}          {one['steps']} steps: {one['in_steps_s']:.3f} s in them, "
              f"{one['between_steps_s']:.3f} s between (longest {one['longest_gap_ms']:.1f} ms), "
              f"{one['before_first_step_ms']} ms before the first (the first request arrived at "
              f"{one['first_arrival_ms']} ms, rows submitted from {one['first_submit_ms']} to {one['last_submit_ms']} "
              f"ms), {one['after_last_step_ms']} ms after the last; a 2 ms sleeper woke up "
              f"to {one['wake_lag_p99_ms']:.2f} ms late (p99); the clients' processes used "
              f"{'/'.join(str(cpu) for cpu in summary['client_cpu_s_each_round'][i])} s of CPU")
    print(f"served != offline        {differing} of {len(results) * len(rounds)} rows (all rounds)"
          + (" (batch_invariant: must be 0)" if args.batch_invariant else ""))
    print(json.dumps(summary))
    if args.batch_invariant and differing:
        raise SystemExit(f"batch_invariant: {differing} served rows differ from the offline batch")


if __name__ == "__main__":
    main()
