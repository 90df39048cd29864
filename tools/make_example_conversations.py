#!/usr/bin/env python3
"""Write the bundled example conversations (seeded, reproducible, written for this project).

Conversations are assembled from the topic notes and phrasings below: single- and
multi-turn, with and without a system prompt, a share of long ones, and a
ShareGPT-format file (``from``/``value``) beside the OpenAI/HF ``messages`` one.

    python tools/make_example_conversations.py --out-dir examples
"""

from __future__ import annotations

import argparse
import json
import os
import random

TOPICS = {
    "sequence packing": [
        "Packing places several short training sequences into one fixed-size row.",
        "A packed row keeps the start of each sequence so attention does not cross them.",
        "First fit decreasing sorts sequences by length and puts each into the first row with room.",
        "Good packing leaves only a few percent of each row as padding.",
    ],
    "memory maps": [
        "A memory map lets a program read a file as if it were an array in memory.",
        "Only the pages that are touched are read from disk, so opening a large file is cheap.",
        "Several processes can map the same file and share the page cache.",
    ],
    "loss masks": [
        "A loss mask says which positions contribute to the training loss.",
        "In chat fine-tuning the loss is usually taken only on the assistant's replies.",
        "A mask that is all ones trains the model to imitate the user as well.",
        "A mask that is all zeros silently wastes the example.",
    ],
    "tokenizers": [
        "A tokenizer turns text into integer ids from a fixed vocabulary.",
        "Byte pair encoding merges the most frequent pairs of symbols step by step.",
        "Special tokens such as end-of-turn markers are never split.",
    ],
    "gardening": [
        "Tomatoes need at least six hours of direct sun a day.",
        "Water deeply and less often so that roots grow down.",
        "Mulch keeps the soil moist and holds back weeds.",
        "Basil grows well next to tomatoes and likes warm nights.",
    ],
    "bread baking": [
        "Bread needs flour, water, salt and yeast or a sourdough starter.",
        "A long cold rise in the fridge gives the dough more flavour.",
        "Steam in the first minutes of baking lets the crust expand before it sets.",
    ],
    "cycling": [
        "Check the tyre pressure before every long ride.",
        "A chain that is cleaned and oiled shifts smoothly and lasts longer.",
        "Spinning a lighter gear on climbs saves the knees.",
    ],
    "astronomy": [
        "The Moon shows the same face to the Earth because its rotation is locked to its orbit.",
        "Jupiter is the largest planet and has dozens of moons.",
        "Light from the Sun takes a little over eight minutes to reach the Earth.",
    ],
    "python": [
        "A list comprehension builds a list from an iterable in one expression.",
        "Context managers release resources even when an exception is raised.",
        "numpy arrays store numbers of one type contiguously, which makes them fast.",
        "Generators produce values lazily, one at a time.",
    ],
    "history of printing": [
        "Movable type made it cheap to print many copies of the same page.",
        "Printed books spread ideas faster than hand copying ever could.",
        "Early printers often cast their own letters in metal.",
    ],
}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in a few sentences.",
    "You are a patient teacher who explains things step by step.",
    "You answer questions about {topic} accurately and plainly.",
]

QUESTIONS = [
    "What should I know about {topic}?",
    "Can you explain {topic} to a beginner?",
    "Give me one practical tip about {topic}.",
    "Why does {topic} matter?",
    "I keep getting confused by {topic}. Where do I start?",
]

FOLLOW_UPS = [
    "Can you say more about that?",
    "Could you give an example?",
    "What is a common mistake here?",
    "How would you summarise that in one line?",
    "Thanks. Anything else I should watch out for?",
]

OPENERS = ["Sure.", "Good question.", "Happy to help.", "Here is the short version.", "Of course."]
CLOSERS = ["", " Let me know if you want more detail.", " I hope that helps.", " Ask again any time."]


def _reply(rng: random.Random, topic: str, long: bool) -> str:
    facts = TOPICS[topic]
    n = rng.randint(6, 14) if long else rng.randint(1, 3)
    body = " ".join(rng.choice(facts) for _ in range(n))
    if long:
        steps = "\n".join(f"{i + 1}. {rng.choice(facts)}" for i in range(rng.randint(3, 8)))
        body = f"{body}\n\nIn steps:\n{steps}"
    return f"{rng.choice(OPENERS)} {body}{rng.choice(CLOSERS)}"


def make_conversation(rng: random.Random) -> list:
    topic = rng.choice(sorted(TOPICS))
    long = rng.random() < 0.12
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS).format(topic=topic)})
    turns = rng.choice([1, 1, 2, 2, 3, 4])
    for t in range(turns):
        question = rng.choice(QUESTIONS if t == 0 else FOLLOW_UPS).format(topic=topic)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": _reply(rng, topic, long and t == turns - 1)})
    return messages


def to_sharegpt(messages: list) -> list:
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="examples", help="directory to write into (default: examples)")
    p.add_argument("--count", type=int, default=400, help="conversations in messages format (default: 400)")
    p.add_argument("--sharegpt-count", type=int, default=60,
                   help="conversations in ShareGPT format (default: 60)")
    p.add_argument("--seed", type=int, default=1234, help="random seed (default: 1234)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rng = random.Random(args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "conversations.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(args.count):
            f.write(json.dumps({"messages": make_conversation(rng)}, ensure_ascii=False) + "\n")
    with open(os.path.join(args.out_dir, "conversations_sharegpt.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(args.sharegpt_count):
            f.write(json.dumps({"conversations": to_sharegpt(make_conversation(rng))}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
