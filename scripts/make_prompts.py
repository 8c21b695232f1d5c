"""Writes the English benchmark prompt set (scripts/prompts/english_1k.jsonl): 1,000 distinct sentences of ~10 words
(questions, numbers, dates, names, quotes and other punctuation), drawn deterministically from the templates and word
lists below, so that the set can be rebuilt offline and every run of `scripts/bench_gateway.py --mode open` and of
nari-labs' `tts_bench` (scripts/tts_bench/) speaks the same text. Each line is `{"id": ..., "text": ...}`, the
JSONL snapshot form `tts_bench run --dataset` reads.
    python scripts/make_prompts.py            # rewrites the committed file (byte-identical for the same seed)
"""
from __future__ import annotations

import argparse
import json
import random
import re
import unicodedata
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "prompts" / "english_1k.jsonl"
# tts_bench's own word count (tts_bench/dataset.py count_words): "3:45" is two words, "o'clock" and "well-known" one
WORD = re.compile(r"[A-Za-z0-9]+(?:['\N{RIGHT SINGLE QUOTATION MARK}-][A-Za-z0-9]+)*")

SLOTS = {
    "name": "Maria James Aisha Kenji Olivia Mateo Priya Daniel Fatima Lucas Chloe Omar Ingrid Tomas Grace Ravi "
            "Nadia Samuel Elena Victor Hannah Diego Mei Patrick Zara Felix".split(),
    "title": "Dr. Mrs. Mr. Professor Captain Ms.".split(),
    "surname": "Okafor Lindqvist Moreau Tanaka Fitzgerald Alvarez Novak Chen Abernathy Kowalski Haddad Brennan "
               "Oyelaran Petrov Santos".split(),
    "city": "Lisbon Nairobi Toronto Osaka Denver Krakow Melbourne Cairo Seattle Edinburgh Bogota Helsinki Austin "
            "Marseille Chennai".split(),
    "day": "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split(),
    "month": "January February March April May June July August September October November December".split(),
    "obj": "invoice package report ticket contract laptop umbrella bicycle recipe password schedule guitar "
           "battery manuscript".split(),
    "objs": "keys tomatoes batteries envelopes candles notebooks boxes chairs photos bottles".split(),
    "adj": "quiet bright crowded careful strange gentle heavy ancient reliable clever".split(),
    "place": "the library, the train station, the harbor, the old bakery, the museum, the parking garage, "
             "the clinic, the rooftop garden".split(", "),
    "verb": "fixed found moved painted cancelled signed delivered borrowed cleaned ordered".split(),
    "feeling": "surprised relieved worried delighted confused proud".split(),
    "food": "lentil soup, lemon cake, grilled fish, mushroom risotto, apple pie, spicy noodles".split(", "),
    "weather": "rain, snow, fog, a heat wave, strong winds, thunderstorms".split(", "),
}

TEMPLATES = (
    "Did {name} remember to bring the {obj} to {place}?",
    "The meeting with {title} {surname} moves to {hour}:{minute} on {day}.",
    "Please call {name} back before {hour} o'clock tonight.",
    "{name} {verb} the {obj} last {day}, and nobody noticed.",
    "How many {objs} do we still need for the party?",
    "Your order number is {number}, and it ships on {month} {ordinal}.",
    "The flight to {city} leaves at {hour}:{minute}; boarding starts twenty minutes earlier.",
    "I honestly thought the {obj} was in the car!",
    "Why would anyone leave {count} {objs} on the kitchen table?",
    "\"We're almost there,\" said {name}, pointing toward {place}.",
    "It costs ${dollars}.{cents}, which is cheaper than last year.",
    "The forecast for {city} calls for {weather} until {day} afternoon.",
    "{name} and {name2} were {feeling} to see the {adj} garden.",
    "Turn left at {place}, then walk about {count} blocks north.",
    "Is the {obj} really worth {dollars} dollars?",
    "About {percent} percent of the votes were counted by midnight.",
    "In {year}, {name} moved from {city} to {city2} for work.",
    "Could you spell your last name for me, {name}?",
    "{title} {surname} recommends the {food} — it's excellent.",
    "We sold {thousands},{hundreds} tickets in the first week alone.",
    "Wait, is that {name}'s {obj} or mine?",
    "The {adj} dog slept under the porch (as usual) all afternoon.",
    "Room {room} is on the {ordinal} floor, next to the elevators.",
    "Unless there's {weather}, we'll eat {food} on the terrace.",
    "{name} asked, \"Have you ever been to {city}?\"",
    "The train was {count} minutes late, so I missed the {obj} delivery.",
    "Remember: the {obj}, the {objs}, and the {obj2} go in the blue box.",
    "What time does {place} open on {day}?",
    "My phone number is {phone}; text me when you arrive.",
    "Honestly, the {adj} old {obj} still works better than the new one.",
    "Thanks, {name}! I couldn't have {verb} it without you.",
    "On {month} {ordinal}, {year}, the bridge finally reopened.",
    "{name}, are you coming?",
    "Happy birthday, {name}!",
    "When {name} finally reached {city} after {count} hours on the road, the {adj} hotel had already given the "
    "room away, so {name2} drove over with {food} and a spare blanket.",
    "According to {title} {surname}, the {obj} should be {verb} by {day}, although nobody on the team seems to "
    "know why.",
)
ORDINALS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth fifteenth twentieth "
            "twenty-first thirtieth").split()


def count_words(text: str) -> int:
    return len(WORD.findall(unicodedata.normalize("NFKC", text)))


def fill(template: str, rng: random.Random) -> str:
    """One sentence: each slot drawn from its list (a second slot of a kind, `name2`, differs from the first)."""
    values = {key: rng.choice(words) for key, words in SLOTS.items()}
    values |= {f"{key}2": rng.choice([w for w in words if w != values[key]]) for key, words in SLOTS.items()}
    values |= dict(hour=rng.randint(1, 12), minute=f"{rng.randrange(0, 60, 5):02d}", count=rng.randint(2, 19),
                   number=rng.randint(10_000, 99_999), ordinal=rng.choice(ORDINALS), dollars=rng.randint(3, 499),
                   cents=f"{rng.randint(0, 99):02d}", percent=rng.randint(11, 97), year=rng.randint(1952, 2024),
                   thousands=rng.randint(2, 48), hundreds=f"{rng.randint(0, 999):03d}", room=rng.randint(101, 940),
                   phone=f"555-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}")
    return template.format(**values)


def prompts(count: int, seed: int) -> list[str]:
    """`count` distinct sentences, templates taken in turn (a repeat is drawn again: every template has slots)."""
    rng, seen, out = random.Random(seed), set(), []
    for attempt in range(100 * count):
        if len(out) == count:
            break
        text = fill(TEMPLATES[attempt % len(TEMPLATES)], rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    if len(out) < count:
        raise ValueError(f"the templates make only {len(out)} distinct sentences")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()
    lines = [json.dumps({"id": f"en-{i:04d}", "text": text}, ensure_ascii=False)
             for i, text in enumerate(prompts(args.count, args.seed))]
    args.output.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
