"""Generates the built-in search-r1 data: a corpus of facts about invented entities and
questions about them (NQ/HotpotQA JSONL shape), so answering needs retrieval and the run
works offline. Deterministic: the same files every time.

    python -m agentrl.envs.search_r1.make_data [--out DIR]

Writes ``corpus.jsonl`` (``{"id", "contents"}``; contents = ``"Title"\\ntext``, Search-R1's
wiki format), ``train.jsonl`` and ``test.jsonl`` (``{"id", "question", "golden_answers",
"hops"}``). 100 entities (people, cities, companies) x 3 attributes = 300 facts, one
passage each; 200 questions, a fifth of them two-hop (the answer of one fact is the
subject of another).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_DIR = Path(__file__).with_name("data")
SEED = 20240601

ONSETS = ("b", "br", "d", "dr", "f", "g", "gl", "h", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st", "t",
          "th", "v", "vr", "z", "zh")
VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou", "y")
CODAS = ("", "", "n", "r", "l", "s", "th", "x", "m", "nd", "rk", "sh")

OCCUPATIONS = ("astronomer", "glassblower", "cartographer", "violinist", "botanist", "clockmaker", "architect",
               "sculptor", "linguist", "beekeeper", "chemist", "novelist", "shipwright", "mathematician",
               "weaver", "geologist", "painter", "engineer", "historian", "chef")
PRODUCTS = ("lanterns", "bicycles", "telescopes", "umbrellas", "pianos", "kites", "compasses", "typewriters",
            "tea kettles", "sailcloth", "clocks", "maps", "violins", "lenses", "ceramic tiles")
LANDMARKS = ("bell tower", "salt market", "stone bridge", "lighthouse", "botanical garden", "observatory",
             "glass dome", "floating theatre", "copper gate", "river harbor")


class Names:
    """Unique pronounceable invented names."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) for _ in range(syllables))
            w = (w + self.rng.choice(CODAS)).capitalize()
            if w not in self.used and 4 <= len(w) <= 11:
                self.used.add(w)
                return w


def build(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    names = Names(rng)
    countries = [names.word(3) for _ in range(12)]
    cities = [{"name": names.word(2), "country": rng.choice(countries), "landmark": rng.choice(LANDMARKS),
               "founded": rng.randint(1100, 1890)} for _ in range(30)]
    people = [{"name": f"{names.word(2)} {names.word(2)}", "born_in": rng.choice(cities)["name"],
               "occupation": rng.choice(OCCUPATIONS), "born": rng.randint(1820, 1990)} for _ in range(40)]
    companies = [{"name": f"{names.word(2)} {rng.choice(('Works', 'Company', 'Guild', 'Industries', 'Foundry'))}",
                  "founder": rng.choice(people)["name"], "hq": rng.choice(cities)["name"],
                  "product": rng.choice(PRODUCTS)} for _ in range(30)]
    city_by, person_by = {c["name"]: c for c in cities}, {p["name"]: p for p in people}

    facts: list[tuple[str, str]] = []  # (title, sentence)
    questions: list[dict] = []

    def fact(title: str, text: str, question: str, answers: list[str]) -> None:
        facts.append((title, text))
        questions.append({"question": question, "golden_answers": answers, "hops": 1})

    for c in cities:
        n = c["name"]
        fact(n, f"{n} is a city in the country of {c['country']}.",
             f"In which country is the city of {n}?", [c["country"]])
        fact(n, f"{n} is known for its {c['landmark']}, which draws visitors every summer.",
             f"What is the city of {n} known for?", [c["landmark"], f"its {c['landmark']}"])
        fact(n, f"{n} was founded in the year {c['founded']} by river traders.",
             f"In what year was the city of {n} founded?", [str(c["founded"])])
    for p in people:
        n, surname = p["name"], p["name"].split()[1]
        fact(n, f"{n} was born in the city of {p['born_in']}.",
             f"Where was {n} born?", [p["born_in"]])
        fact(n, f"{n} worked as a {p['occupation']} for most of their life.",
             f"What was the occupation of {n}?", [p["occupation"], f"a {p['occupation']}"])
        fact(n, f"{n} was born in {p['born']}; {surname} is remembered in local records.",
             f"In what year was {n} born?", [str(p["born"])])
    for co in companies:
        n = co["name"]
        fact(n, f"{n} was founded by {co['founder']}.", f"Who founded {n}?",
             [co["founder"], co["founder"].split()[1]])
        fact(n, f"{n} has its headquarters in {co['hq']}.", f"Where is {n} headquartered?", [co["hq"]])
        fact(n, f"{n} is best known for making {co['product']}.", f"What does {n} make?", [co["product"]])

    two_hop = []
    for co in companies:
        founder = person_by[co["founder"]]
        two_hop.append({"question": f"In which city was the founder of {co['name']} born?",
                        "golden_answers": [founder["born_in"]], "hops": 2})
        two_hop.append({"question": f"What was the occupation of the founder of {co['name']}?",
                        "golden_answers": [founder["occupation"], f"a {founder['occupation']}"], "hops": 2})
        two_hop.append({"question": f"In which country is the headquarters of {co['name']}?",
                        "golden_answers": [city_by[co["hq"]]["country"]], "hops": 2})
    for p in people:
        two_hop.append({"question": f"In which country was {p['name']} born?",
                        "golden_answers": [city_by[p["born_in"]]["country"]], "hops": 2})

    corpus = [{"id": str(i), "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(facts)]
    rng.shuffle(questions)
    rng.shuffle(two_hop)
    chosen = questions[:160] + two_hop[:40]
    rng.shuffle(chosen)
    qs = [{"id": f"synth-{i}", **q} for i, q in enumerate(chosen)]
    return corpus, qs


def write(out: Path = DATA_DIR) -> dict[str, Path]:
    corpus, questions = build()
    out.mkdir(parents=True, exist_ok=True)
    files = {"corpus": out / "corpus.jsonl", "train": out / "train.jsonl", "test": out / "test.jsonl"}
    splits = {"corpus": corpus, "train": questions[:180], "test": questions[180:]}
    for key, path in files.items():
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in splits[key]))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(DATA_DIR), help="output folder (default: the package's data/)")
    args = parser.parse_args(argv)
    for key, path in write(Path(args.out)).items():
        print(f"{key}: {path} ({sum(1 for _ in path.open())} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
