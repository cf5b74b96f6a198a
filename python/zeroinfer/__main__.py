"""The `zeroinfer` command line: generate, chat, bench. The default model is a tiny dummy, so
`zeroinfer generate "Hello"` works on a fresh CPU machine."""

from __future__ import annotations

import argparse
import json
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="dummy", help='checkpoint dir or "dummy[:name]" (default: dummy)')
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync", action="store_true", help="disable the zero-overhead async pipeline")
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs: decode rounds run op by op")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: K=V caches in the V4 FP8 layout (584 bytes a vector)")
    p.add_argument("--ep-ranks", type=int, default=1,
                   help="expert parallelism over this many ranks, one process each on this "
                        "machine (one GPU each over NCCL, or CPU processes over gloo)")
    p.add_argument("--redundant-experts", type=int, default=0,
                   help="expert parallelism: extra expert slots for the load balancer")
    p.add_argument("--eplb-interval", type=int, default=0,
                   help="expert parallelism: rebalance the experts every this many rounds "
                        "(0: never), from the load of the last --eplb-window rounds")
    p.add_argument("--eplb-window", type=int, default=100)
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="speculative decoding: verify up to this many drafts a decode row "
                        "(0: off)")
    p.add_argument("--speculative-method", default="ngram", choices=["ngram", "mtp"],
                   help="the drafter: n-gram prompt lookup, or the model's MTP module")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    so = p.add_mutually_exclusive_group()  # structured output (xgrammar)
    so.add_argument("--json-schema", default=None,
                    help="keep the output to this JSON schema (its text, or @file), as compact "
                         "JSON (no whitespace between tokens: a model cannot pad it forever)")
    so.add_argument("--regex", default=None, help="keep the output to this regular expression")
    so.add_argument("--choice", action="append", default=None,
                    help="the output is one of these strings (repeat the flag)")


def _llm(a, ep=None):
    from zeroinfer import LLM

    return LLM(a.model, device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
               max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens,
               seed=a.seed, async_scheduling=not a.sync,
               decode_graphs=False if a.eager else None, kv_cache_dtype=a.kv_cache_dtype,
               ep=ep, speculative=_speculative(a))


def _speculative(a):
    if a.speculative_tokens < 0:
        raise SystemExit(f"--speculative-tokens must be >= 0, got {a.speculative_tokens}")
    if not a.speculative_tokens:
        return None
    from zeroinfer import SpeculativeConfig

    return SpeculativeConfig(num_draft_tokens=a.speculative_tokens, method=a.speculative_method)


def _output(o) -> dict:
    return {"request_id": o.request_id, "prompt": o.prompt, "text": o.text,
            "token_ids": o.token_ids, "finish_reason": o.finish_reason}


def _generate_rank(rank: int, world: int, a, prompts: list[str]) -> list[dict]:
    """One expert-parallel rank of `generate --ep-ranks`: prompts i with i % world == rank."""
    import torch

    from zeroinfer.llm import _resolve_device
    from zeroinfer.model import model_config
    from zeroinfer.parallel import ExpertParallel

    dev = _resolve_device(a.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
        a.device = str(dev)
    window = a.eplb_window if a.eplb_interval else 0
    ep = ExpertParallel.for_model(model_config(a.model), redundant_experts=a.redundant_experts,
                                  device=dev, load_window=min(window, a.eplb_interval),
                                  rebalance_interval=a.eplb_interval)
    llm = _llm(a, ep)
    outs = llm.generate(prompts[rank::world], _params(a), use_tqdm=False)
    return [_output(o) for o in outs]


def _generate_ep(a, prompts: list[str]) -> list[dict]:
    from zeroinfer.llm import _resolve_device
    from zeroinfer.parallel.launch import run_ranks

    gpu = _resolve_device(a.device).type == "cuda"
    if gpu:
        import torch

        if torch.cuda.device_count() < a.ep_ranks:
            raise ValueError(f"--ep-ranks {a.ep_ranks} needs a GPU a rank; "
                             f"{torch.cuda.device_count()} visible")
    # The ranks are spawned: they unpickle the worker by its module's name, which is
    # "__main__" here under `python -m zeroinfer`; so pass the importable module's function,
    # and the arguments without the parser's callback.
    import zeroinfer.__main__ as cli

    args = argparse.Namespace(**{k: v for k, v in vars(a).items() if k != "fn"})
    per_rank = run_ranks(cli._generate_rank, a.ep_ranks, args, prompts,
                         backend="nccl" if gpu else "gloo")
    # back to the input order (prompt i was rank i % world's (i // world)-th), numbered so
    return [{**per_rank[i % a.ep_ranks][i // a.ep_ranks], "request_id": str(i)}
            for i in range(len(prompts))]


def _params(a):
    from zeroinfer import SamplingParams, StructuredOutput

    so = None
    if a.json_schema is not None:
        text = a.json_schema
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        so = StructuredOutput(json=text, any_whitespace=False)
    elif a.regex is not None:
        so = StructuredOutput(regex=a.regex)
    elif a.choice:
        so = StructuredOutput(choice=a.choice)
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                          top_p=a.top_p, min_p=a.min_p, stop=a.stop, ignore_eos=a.ignore_eos,
                          structured=so)


def cmd_generate(a) -> int:
    prompts = list(a.prompts)
    if a.file:
        with open(a.file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("zeroinfer generate: no prompts (give them as arguments, --file or stdin)", file=sys.stderr)
        return 2
    if a.ep_ranks < 1:
        raise ValueError(f"--ep-ranks must be >= 1, got {a.ep_ranks}")
    if a.ep_ranks > 1:
        outs = _generate_ep(a, prompts)
    else:
        results = _llm(a).generate(prompts, _params(a), use_tqdm=not a.quiet)
        outs = [_output(o) for o in results]
        if a.speculative_tokens:  # (on stderr: the JSON lines stay the same with or without)
            drafted = sum(o.num_drafted for o in results)
            kept = sum(o.num_accepted for o in results)
            print(f"speculative ({a.speculative_method}, up to {a.speculative_tokens} drafts a "
                  f"row): {kept} of {drafted} drafts kept"
                  + (f" ({kept / drafted:.1%})" if drafted else ""), file=sys.stderr)
    for o in outs:
        print(json.dumps(o, ensure_ascii=False))
    return 0


def cmd_chat(a) -> int:
    llm = _llm(a)
    messages = [{"role": "system", "content": a.system}] if a.system else []

    def reply(text: str) -> None:
        messages.append({"role": "user", "content": text})
        out = llm.chat(messages, _params(a), use_tqdm=False)[0]
        m = out.message
        content = getattr(m, "content", out.text)
        if getattr(m, "reasoning_content", None):
            print(f"[thinking] {m.reasoning_content}")
        print(content)
        messages.append({"role": "assistant", "content": content})

    if a.message:
        reply(a.message)
        return 0
    try:
        while True:
            line = input("> ")
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip():
                reply(line)
    except EOFError:
        return 0


def cmd_bench(a) -> int:
    from zeroinfer.engine.bench import run_engine_bench

    run_engine_bench(a)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="zeroinfer", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="complete prompts; prints one JSON object per prompt")
    g.add_argument("prompts", nargs="*")
    g.add_argument("--file", help="a file with one prompt per line")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("chat", help="chat with the model (interactive, or one-shot with -m)")
    c.add_argument("-m", "--message")
    c.add_argument("--system")
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(fn=cmd_chat)
    b = sub.add_parser("bench", help="synthetic workload: prints a table and writes JSON")
    b.add_argument("--model", default="dummy")
    b.add_argument("--device", default="auto")
    b.add_argument("--batch-sizes", default="1,8,32", help="comma-separated decode batch sizes")
    b.add_argument("--input-len", type=int, default=32)
    b.add_argument("--output-len", type=int, default=32)
    b.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    b.add_argument("--out-dir", default=None, help="results root (default bench/results)")
    b.set_defaults(fn=cmd_bench)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (ValueError, TypeError, OSError) as e:  # (OSError: a --file or @schema not there)
        print(f"zeroinfer {a.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
