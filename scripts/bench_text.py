"""CPU time of the text work one client's input costs the server, on hostile and ordinary inputs: pronunciation
lexicons (`realtime.lexicon`, on the event loop for every append, and compiled where a client gives one inline), the
utterance planner (`realtime.ws.utterances`, on the event loop for every append and speech request), LLM clean-up
(`engine.text.cleanup`, in the engine's step loop) and the log redaction of a request line (`realtime.server.redact`,
on the event loop). A cost that grows
faster than the text stalls every other stream (docs/benchmarks.md, "Text work per input").

Each figure is the thread's CPU time, the least of `--repeats` runs, for inputs of `--chars` characters. Prints one
JSON object.
    python scripts/bench_text.py
    python scripts/bench_text.py --chars 2000 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.text.cleanup import clean_text  # noqa: E402
from realtime import lexicon as lexicons  # noqa: E402
from realtime.lexicon import parse_rules  # noqa: E402
from realtime.server import redact  # noqa: E402
from realtime.ws.utterances import UtterancePlanner  # noqa: E402

# lexicons whose terms text can almost match at every word, or match nested inside each other
LEXICONS = {
    "one long term": [{"term": " ".join(["a"] * 49) + " b", "replacement": "x"}],
    "48 terms a a ... b": [{"term": "a " * i + "b", "replacement": "x"} for i in range(1, 49)],
    "50 nested terms": [{"term": " ".join(["a"] * i), "replacement": "x"} for i in range(1, 51)],
    "100 runs of a": [{"term": "a" * i, "replacement": "x"} for i in range(1, 101)],
    "one short term": [{"term": "a", "replacement": "x"}],
    # a term that keeps the matcher's cursor waiting while the nested ones end at every word inside it
    "x a ... a over 49 nested": [{"term": "x" + " a" * 49, "replacement": "y"}] + [
        {"term": " ".join(["a"] * i), "replacement": "x"} for i in range(1, 50)],
}
TEXTS = {"a a a": "a ", "aaaa": "a", "x a a a": "x " + "a " * 48, "prose": "hello world, this is fine. "}
CLEANUP_TEXTS = {"link openings": "[x](", "emphasis marks": "*_", "prose": "hello **world**, this is fine. "}
QUERIES = {"question marks": "?", "names": "?a", "pairs": "&a=1"}
PLANNER_TEXTS = {"prose": "hello world, this is fine. ", "CJK": "你好世界，今天天气很好。", "one word": "a",
                 "words without punctuation": "abcdefgh "}
# the largest lexicon allowed, of terms that share no prefix: the most trie nodes a client can ask for at once
LARGEST_LEXICON = [{"term": f"{i:03d}" + "".join(chr(97 + (i * 7 + j * 3) % 26) for j in range(46)), "replacement": "x"}
                   for i in range(1000)]


def cpu_seconds(work: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        work()
        best = min(best, time.thread_time() - started)
    return best


def of_length(unit: str, chars: int) -> str:
    return unit * (chars // len(unit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=20_000, help="length of each input (a context takes 20,000)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ms = {}
    for name, rules in LEXICONS.items():
        lexicon = parse_rules(rules)
        for text_name, unit in TEXTS.items():
            text = of_length(unit, args.chars)
            ms[f"lexicon {name} on {text_name}"] = cpu_seconds(lambda: lexicon.apply(text), args.repeats) * 1e3
    def compile_largest() -> None:
        lexicons.TRIES = lexicons.Tries(lexicons.MAX_TRIE_NODES, keep=0)  # a fresh one: nothing shared
        parse_rules(LARGEST_LEXICON)

    ms["lexicon compile, the largest allowed"] = cpu_seconds(compile_largest, args.repeats) * 1e3
    for name, unit in PLANNER_TEXTS.items():
        text = of_length(unit, args.chars)
        ms[f"utterance planner on {name}"] = cpu_seconds(
            lambda: UtterancePlanner("none", max_utterance_chars=600).append(text, 0.0), args.repeats) * 1e3
    for name, unit in CLEANUP_TEXTS.items():
        text = of_length(unit, args.chars)
        ms[f"clean-up of {name}"] = cpu_seconds(lambda: clean_text(text), args.repeats) * 1e3
    for name, unit in QUERIES.items():
        line = "GET /health" + of_length(unit, args.chars)
        ms[f"redaction of {name}"] = cpu_seconds(lambda: redact(line), args.repeats) * 1e3
    print(json.dumps({"chars": args.chars, "repeats": args.repeats,
                      "cpu_ms": {name: round(value, 2) for name, value in ms.items()}}, indent=1))


if __name__ == "__main__":
    main()
