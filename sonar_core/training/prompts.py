"""Prompts for self-distillation, in four domains, made offline from what this machine already has.

A draft head learns the target's habits from the target's own answers, so the prompts only need to
be varied: the target writes the training text. They come from

* ``code``: functions of the Python standard library installed with the interpreter (their source,
  signature and docstring; pure-Python functions only), plus small programming tasks;
* ``explanation``: the topics of the Python language reference shipped in ``pydoc_data`` (a passage
  to summarise, a feature to explain) and general concepts;
* ``chat``: everyday requests built from subjects and phrasings;
* ``structured``: JSON, CSV, YAML and Markdown tasks over procedurally generated records.

Everything is drawn from one seeded generator, so a seed gives the same prompts on the same
interpreter. The phrasings differ from the benchmark workloads' (``sonar_core/bench/workloads``),
which stay a held-out test.
"""

from __future__ import annotations

import inspect
import random
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass

DOMAINS = ("code", "chat", "explanation", "structured")
# Standard-library modules whose pure-Python functions make code prompts.
_CODE_MODULES = (
    "bisect", "calendar", "colorsys", "csv", "difflib", "fnmatch", "fractions", "ftplib", "functools", "glob",
    "gzip", "heapq", "html", "ipaddress", "json", "keyword", "locale", "mimetypes", "ntpath", "operator",
    "optparse", "os", "pathlib", "pickle", "platform", "posixpath", "pprint", "quopri", "random", "shlex",
    "shutil", "statistics", "string", "tempfile", "textwrap", "tokenize", "urllib.parse", "uuid", "wave",
    "webbrowser", "zipfile",
)
_MAX_SOURCE_LINES = 28
_PASSAGE_WORDS = 90
_CODE_TASKS = (
    "checks whether a string is a palindrome, ignoring case and punctuation",
    "merges two sorted lists into one sorted list",
    "counts how often each word appears in a text",
    "returns the n-th Fibonacci number iteratively",
    "flattens a nested list of any depth",
    "parses a date written as DD/MM/YYYY and returns the weekday",
    "removes duplicate items from a list while keeping their order",
    "converts a Roman numeral to an integer",
    "finds the longest common prefix of a list of strings",
    "groups a list of dictionaries by the value of one key",
    "validates an email address with a regular expression",
    "computes the moving average of a list of numbers",
    "rotates a matrix by 90 degrees",
    "reads a CSV file and returns the average of one column",
    "implements binary search over a sorted list",
    "chunks a list into pieces of a given size",
)
_LANGUAGES = ("Python", "JavaScript", "Go", "Rust", "Java", "C", "TypeScript", "Ruby")
_CONCEPTS = (
    "photosynthesis", "compound interest", "how vaccines train the immune system", "why the sky is blue",
    "ocean tides", "how a refrigerator keeps food cold", "public-key cryptography", "the water cycle",
    "inflation", "how GPS finds your position", "plate tectonics", "how a hash table works", "recursion",
    "the greenhouse effect", "supply and demand", "how bread rises", "how noise-cancelling headphones work",
    "garbage collection in programming languages", "the difference between weather and climate",
    "how a search engine ranks pages", "what a database index does", "how airplanes stay in the air",
    "why leaves change colour in autumn", "how batteries store energy", "the placebo effect",
)
_SUBJECTS = (
    "learning the guitar", "a weekend trip to the mountains", "saving money on groceries", "training a puppy",
    "starting to run", "keeping a journal", "cooking for a family of five", "moving to a new city",
    "growing herbs indoors", "a job interview", "a birthday party for a seven-year-old", "learning Spanish",
    "repairing a bicycle puncture", "a first camping trip", "decluttering a small flat", "public speaking",
    "sleeping better", "planning a vegetable garden", "choosing a laptop", "a rainy day with kids",
    "hosting a dinner party", "staying focused while working from home", "writing a short story",
    "taking better phone photos", "a road trip across the country", "baking cookies", "making new friends",
    "learning to swim as an adult", "organising a book club", "painting a bedroom", "meal prepping for a busy week",
    "a long-haul flight", "volunteering at an animal shelter", "learning chess", "a family reunion",
    "reducing screen time", "preparing for a marathon", "keeping houseplants alive", "writing a thank-you letter",
    "buying a second-hand car", "teaching a teenager to cook", "starting a small online shop", "a picnic in the park",
)
_CONSTRAINTS = (
    "", "", " I am on a tight budget.", " I only have an hour a day.", " I am a complete beginner.",
    " I have two small children.", " I live in a small flat.", " It is the middle of winter.",
    " Please keep the answer short.", " I prefer a step-by-step list.",
)
_CHAT_TEMPLATES = (
    "Can you help me plan {s}? I have about a week to prepare.",
    "My friend asked me for advice about {s}. What should I tell them?",
    "What mistakes do beginners usually make with {s}?",
    "Make a checklist for {s}.",
    "I feel a bit overwhelmed by {s}. Can you break it into small steps?",
    "Write a friendly message inviting my neighbour to join me for {s}.",
    "What questions should I ask myself before {s}?",
    "Give me a simple weekly schedule for {s}.",
    "Describe a typical day of someone who is really good at {s}.",
    "Pros and cons: doing {s} alone or with a group?",
)
_EXPLAIN_TEMPLATES = (
    "Explain {c} in plain words, then give an everyday example.",
    "How would you describe {c} to someone who has never heard of it?",
    "What is a common misconception about {c}, and what is actually true?",
    "Write a short paragraph for a school textbook about {c}.",
)
_FIRST_NAMES = ("Ana", "Ben", "Chloe", "Dmitri", "Elif", "Farah", "Gustav", "Hana", "Ivo", "Jade", "Kofi", "Lena")
_LAST_NAMES = ("Silva", "Okafor", "Nguyen", "Kowalski", "Haddad", "Moreau", "Tanaka", "Larsen", "Rossi", "Patel")
_CITIES = ("Lisbon", "Accra", "Hanoi", "Krakow", "Beirut", "Lyon", "Osaka", "Bergen", "Turin", "Pune", "Quito")
_PRODUCTS = ("desk lamp", "water bottle", "backpack", "notebook", "headphones", "kettle", "umbrella", "keyboard")
_COLOURS = ("red", "blue", "green", "black", "white", "yellow", "grey")


@dataclass(frozen=True)
class TrainingPrompt:
    """One chat request: an id unique in its set, its domain and its messages."""

    id: str
    domain: str
    messages: tuple[dict[str, str], ...]

    @property
    def text(self) -> str:
        return self.messages[-1]["content"]


def build_prompts(count: int, seed: int) -> list[TrainingPrompt]:
    """``count`` distinct prompts, the domains in turn (code, chat, explanation, structured, ...),
    deterministic for ``seed``. Raises ValueError when the sources cannot give that many."""
    rng = random.Random(seed)
    makers: dict[str, Callable[[random.Random], str]] = {
        "code": _code_maker(rng),
        "chat": _chat,
        "explanation": _explanation_maker(),
        "structured": _structured,
    }
    seen: set[str] = set()
    prompts: list[TrainingPrompt] = []
    attempts = 0
    while len(prompts) < count:
        domain = DOMAINS[len(prompts) % len(DOMAINS)]
        text = makers[domain](rng)
        attempts += 1
        if attempts > 50 * max(count, 1):
            raise ValueError(f"could not make {count} distinct prompts (made {len(prompts)}); ask for fewer")
        if text in seen:
            continue
        seen.add(text)
        prompts.append(TrainingPrompt(f"{domain}-{len(prompts):06d}", domain, ({"role": "user", "content": text},)))
    return prompts


def _code_maker(rng: random.Random) -> Callable[[random.Random], str]:
    functions = list(_stdlib_functions())
    rng.shuffle(functions)

    def make(rng: random.Random) -> str:
        if not functions or rng.random() < 0.25:
            return rng.choice((
                "Write a {lang} function that {task}. Explain your approach briefly.",
                "Show me idiomatic {lang} code that {task}, with comments.",
                "What is the time complexity of a function that {task}? Write one in {lang}.",
            )).format(lang=rng.choice(_LANGUAGES), task=rng.choice(_CODE_TASKS))
        name, signature, doc, source = rng.choice(functions)
        template = rng.choice((
            "Explain step by step what this Python function does:\n\n```python\n{source}```",
            "Rewrite this Python function so that it is easier to read, keeping its behaviour:\n\n```python\n{source}```",
            "Add type hints and a docstring to this function:\n\n```python\n{source}```",
            "Write three pytest tests for `{name}{signature}`, which does the following: {doc}",
            "Implement `{short}{signature}` from scratch in Python. Its documentation says: {doc}",
            "Find possible bugs or edge cases in this code:\n\n```python\n{source}```",
        ))
        return template.format(source=source, name=name, short=name.rpartition(".")[2], signature=signature, doc=doc)

    return make


def _stdlib_functions() -> Iterator[tuple[str, str, str, str]]:
    """``(qualified name, signature, first docstring line, source)`` of short, documented,
    pure-Python functions of :data:`_CODE_MODULES` (modules that fail to import are skipped)."""
    import importlib

    for module_name in _CODE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, function in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            doc = (inspect.getdoc(function) or "").strip().split("\n\n")[0].replace("\n", " ")
            try:
                source = textwrap.dedent(inspect.getsource(function))
                signature = str(inspect.signature(function))
            except (OSError, TypeError, ValueError):
                continue
            if doc and source.count("\n") <= _MAX_SOURCE_LINES:
                yield f"{module_name}.{name}", signature, doc, source


def _chat(rng: random.Random) -> str:
    return rng.choice(_CHAT_TEMPLATES).format(s=rng.choice(_SUBJECTS)) + rng.choice(_CONSTRAINTS)


def _explanation_maker() -> Callable[[random.Random], str]:
    from pydoc_data.topics import topics

    passages = [(name, _first_words(text, _PASSAGE_WORDS)) for name, text in sorted(topics.items())]

    def make(rng: random.Random) -> str:
        choice = rng.random()
        if choice < 0.4:
            return rng.choice(_EXPLAIN_TEMPLATES).format(c=rng.choice(_CONCEPTS))
        name, passage = rng.choice(passages)
        topic = name.replace("-", " ")
        if choice < 0.7:
            return f"Summarise this passage from the Python language reference in a few sentences:\n\n{passage}"
        return rng.choice((
            "Explain the Python topic '{t}' to a beginner, with a short example.",
            "What are common mistakes people make with '{t}' in Python?",
            "Compare '{t}' in Python with how another language handles it.",
        )).format(t=topic)

    return make


def _first_words(text: str, count: int) -> str:
    words = text.split()
    return " ".join(words[:count]) + (" ..." if len(words) > count else "")


def _person(rng: random.Random) -> dict[str, object]:
    return {
        "name": f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}",
        "age": rng.randint(18, 80),
        "city": rng.choice(_CITIES),
    }


def _product(rng: random.Random) -> dict[str, object]:
    return {
        "product": f"{rng.choice(_COLOURS)} {rng.choice(_PRODUCTS)}",
        "price": round(rng.uniform(3, 250), 2),
        "stock": rng.randint(0, 500),
    }


def _structured(rng: random.Random) -> str:
    make_record = rng.choice((_person, _product))
    records = [make_record(rng) for _ in range(rng.randint(2, 5))]
    keys = list(records[0])
    csv = "\n".join([",".join(keys)] + [",".join(str(r[k]) for k in keys) for r in records])
    sentence = "; ".join(", ".join(f"{k} {r[k]}" for k in keys) for r in records)
    return rng.choice((
        f"Convert this CSV into a JSON array of objects:\n\n{csv}",
        f"Turn this CSV into a Markdown table and add a short summary below it:\n\n{csv}",
        f"Extract the records from this text as JSON with the keys {', '.join(keys)}: {sentence}",
        f"Write a YAML document that lists these entries:\n\n{csv}",
        f"Write a JSON schema for objects like this one, then validate it by hand: {records[0]}",
        f"Sort these rows by {keys[1]} and print them as a Markdown table:\n\n{csv}",
    ))
