"""``dtrain generate`` and ``dtrain eval``: looking at what a run learned (``dtrain.inference``).

``dtrain generate RUN_OR_HF_FOLDER --prompt TEXT`` prints the prompt's continuation (greedy unless
``--temperature`` is set; ``--ids`` takes ids instead of text, for a folder without a tokenizer); ``dtrain eval RUN
[--data STORE]`` prints the loss and perplexity on a store's held-out split, as the run computes its eval figure.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dtrain.errors import DtrainError


def add_parsers(sub: Any, command: Any, int_at_least: Any) -> None:
    """The two subparsers (``command``: main's subcommand maker; ``int_at_least``: its bounded int type)."""
    p = command(sub, "generate", "continue a prompt with a run's or a Hugging Face folder's model (KV cache)",
                "Loads the model (dtrain.load: a run folder's newest θ, or a Hugging Face folder) and prints the\n"
                "prompt followed by its continuation: greedy by default, top-p sampling with --temperature. A folder\n"
                "without a tokenizer takes --ids and prints ids (docs/models.md, Looking at a run).",
                "dtrain generate runs/llama-small --prompt 'def main(' --max-new-tokens 64")
    p.add_argument("folder", metavar="RUN_OR_HF_FOLDER", help="a run folder or a Hugging Face model folder")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", metavar="TEXT", help="the text to continue (encoded with the folder's tokenizer)")
    what.add_argument("--ids", metavar="I,J,...", help="the prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int_at_least(1, "tokens", "must be >= 1"), default=64, metavar="N",
                   help="tokens to generate at most (default 64; fewer at the end-of-document token)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy; > 0: sample softmax(logits / T)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the smallest set of tokens whose probability reaches P (default 1: all)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling seed (default 0)")
    p.add_argument("--version", type=int_at_least(0, "versions", "must be >= 0"), default=None, metavar="V",
                   help="a run's θ version or checkpoint step (default: the newest on disk)")
    p.add_argument("--no-cache", action="store_true", help="run the whole sequence each step (no KV cache)")

    p = command(sub, "eval", "a run's loss and perplexity on a token store's held-out split",
                "Loads the run's θ (dtrain.load) and computes its loss on the held-out split of --data (default: the\n"
                "run's own store) with the run's data settings, batches and eval function: on the run's store, the\n"
                "run's own eval figure for that θ.",
                "dtrain eval runs/tiny --data stores/web")
    p.add_argument("run_dir", metavar="RUN", help="a run folder (a coordinator's run or a dtrain train run)")
    p.add_argument("--data", metavar="STORE", default=None,
                   help="a token store (path or URL; default: the run's own)")
    p.add_argument("--version", type=int_at_least(0, "versions", "must be >= 0"), default=None, metavar="V",
                   help="the θ version or checkpoint step (default: the newest on disk)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def main(args: argparse.Namespace) -> int:
    from dtrain import load

    model = load(args.folder if args.command == "generate" else args.run_dir, version=args.version)
    if args.command == "eval":
        from dtrain.inference.evaluate import held_out_loss

        r = held_out_loss(model, args.data)
        if args.json:
            print(json.dumps({"loss": r.loss, "perplexity": r.perplexity, "store": r.store, "batches": r.batches,
                              "tokens": r.tokens, "model": model.source}))
        else:
            print(f"dtrain eval: {model.source}: loss {r.loss:.6f}, perplexity {r.perplexity:.3f} on {r.store} "
                  f"({r.batches} batches, {r.tokens:,} tokens of its held-out split)")
        return 0
    return _generate(args, model)


def _generate(args: argparse.Namespace, model: Any) -> int:
    import numpy as np

    from dtrain.inference.generate import generate

    tok = model.tokenizer
    if args.prompt is not None:
        if tok is None:
            raise DtrainError(f"{args.folder}: no tokenizer to encode --prompt with ({model.tokenizer_note}): pass "
                              "--ids instead")
        ids, _ = tok.encode_documents([args.prompt])
        prompt = [int(i) for i in ids[:-1]]  # without the end-of-document id the tokenizer appends
        if not prompt:
            raise DtrainError("--prompt is empty: give some text to continue")
    else:
        try:
            prompt = [int(x) for x in args.ids.split(",")]
        except ValueError:
            raise DtrainError(f"--ids {args.ids!r}: not comma-separated integers") from None
    stop = tok.eos_id if tok is not None and not tok.raw else None  # bytes: the eos is "\n", a common character
    new = generate(model, np.array([prompt]), args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, cache=not args.no_cache, stop_id=stop)[0].tolist()
    if stop is not None and new and new[-1] == stop:
        new = new[:-1]  # the end-of-document token ends the text, it is not part of it
    if args.prompt is not None:
        print(args.prompt + tok.decode(new))
    else:
        print(",".join(map(str, prompt + new)))
    return 0
