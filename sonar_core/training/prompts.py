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


# The conversation set: open everyday requests whose answers copy little from the prompt (poems,
# stories, advice, facts, letters, plans), in many phrasings over many subjects. The four domains
# above cover code and formats well but phrase their chat requests in ten ways only; a head trained
# on them alone drafts open chat answers poorly (docs/training.md). Drawn from its own generator, so
# adding it to a data folder leaves the prompts of the four domains, and their files, as they are.
CONVERSATION = "conversation"
_TOPICS = (
    "knitting a scarf", "restoring old furniture", "learning to juggle", "brewing coffee at home",
    "making pottery", "keeping chickens in a garden", "riding a motorbike safely", "playing the piano",
    "fixing a leaking tap", "building a birdhouse", "starting a podcast", "writing poetry", "learning sign language",
    "caring for a cat", "adopting a rescue dog", "keeping an aquarium", "growing strawberries", "pruning roses",
    "stargazing", "hiking in the rain", "kayaking on a lake", "cycling to work", "learning to skate",
    "doing yoga in the morning", "lifting weights safely", "stretching after a workout", "drinking more water",
    "cooking rice perfectly", "making soup from leftovers", "baking a birthday cake", "fermenting vegetables",
    "making fresh pasta", "grilling vegetables", "packing a healthy lunch", "eating less sugar", "brewing tea",
    "visiting a museum with children", "travelling by train", "packing light for a holiday", "visiting Japan",
    "a weekend in Paris", "camping in the desert", "a trip to the seaside", "learning about local history",
    "budgeting for a holiday", "paying off a credit card", "opening a savings account", "negotiating a salary",
    "asking for a promotion", "preparing a presentation", "running a team meeting", "giving feedback kindly",
    "working night shifts", "changing careers at forty", "writing a CV", "studying for an exam", "taking notes in class",
    "learning history dates", "reading more books", "starting a reading habit", "writing a diary in English",
    "learning French verbs", "practising handwriting", "drawing portraits", "painting with watercolours",
    "taking up photography", "editing holiday videos", "making a family tree", "writing a wedding speech",
    "planning a surprise party", "organising a school fair", "decorating for the holidays", "wrapping presents",
    "choosing a gift for a friend", "saying sorry to a friend", "dealing with a noisy neighbour", "sharing a flat",
    "moving house with pets", "cleaning a kitchen quickly", "doing laundry properly", "ironing shirts",
    "sewing on a button", "recycling at home", "saving energy in winter", "keeping a house cool in summer",
    "insulating a window", "choosing a mattress", "setting up a home office", "organising a wardrobe",
    "waking up early", "managing stress", "meditating for ten minutes", "breathing exercises", "calming down before sleep",
    "staying positive", "building confidence", "being a good listener", "remembering names", "managing time",
    "keeping a to-do list", "avoiding procrastination", "learning to code", "protecting passwords",
    "backing up photos", "using a smartphone less", "teaching grandparents to video call", "choosing a bicycle",
    "changing a car tyre", "driving in snow", "washing a car", "walking more every day", "gardening with children",
    "watching birds in winter", "feeding wild hedgehogs", "a visit to the zoo", "the life of bees", "volcanoes",
    "the moon", "rainbows", "thunderstorms", "the deep sea", "dinosaurs", "penguins", "autumn leaves", "snowflakes",
    "the history of chocolate", "the invention of the telephone", "ancient Egypt", "the Roman roads", "the first flight",
    "a lighthouse keeper", "a small bakery", "a village market", "a rainy Sunday", "a long summer evening",
    "an old library", "a lost umbrella", "a friendly robot", "a brave little mouse", "a forgotten key",
)
_DISHES = (
    "lentil soup", "banana bread", "vegetable curry", "pancakes", "tomato pasta", "fried rice", "a green salad",
    "chicken stew", "porridge with fruit", "a cheese omelette", "roasted potatoes", "a fruit smoothie",
    "guacamole", "mushroom risotto", "apple crumble", "hummus", "a bean chili", "oat cookies",
)
_PAIRS = (
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("the city", "the countryside"),
    ("reading on paper", "reading on a screen"), ("running", "swimming"), ("renting", "buying a home"),
    ("summer", "winter"), ("working early", "working late"), ("a laptop", "a tablet"), ("the sea", "the mountains"),
    ("cooking at home", "eating out"), ("walking", "cycling"), ("email", "a phone call"),
)
_QUESTIONS = (
    "Why do cats purr?", "How do birds know where to fly in winter?", "Why is the ocean salty?",
    "How does a rainbow form?", "Why do we dream?", "What makes bread go stale?", "Why do onions make us cry?",
    "How do bees make honey?", "Why do we get hiccups?", "How does a compass work?", "Why is the moon sometimes orange?",
    "How do plants know which way is up?", "Why do leaves fall in autumn?", "How long do elephants live?",
    "What happens to the body when we sleep?", "Why do some people like spicy food?", "How do fish breathe?",
    "Why does ice float?", "How did people tell time before clocks?", "What is the tallest tree in the world?",
    "Why do we yawn?", "How do submarines dive and come back up?", "Why do stars twinkle?",
    "What is the difference between a virus and a bacterium?", "How do you stay motivated on hard days?",
    "What is a good way to start the morning?", "How can I be kinder to myself?", "What makes a good friend?",
    "How do I say no politely?", "What should I cook tonight with rice, eggs and spinach?",
)
_AUDIENCES = (
    "a child", "my grandmother", "a teenager", "a complete beginner", "a busy parent", "a student",
    "someone who has never tried it", "a retired teacher",
)
_CONVERSATION_TEMPLATES = (
    "Write a four-line poem about {t}.", "Write a haiku about {t}.", "Write a limerick about {t}.",
    "Write a short rhyming poem for children about {t}.", "Write a song chorus about {t}.",
    "Write a very short story about {t}.", "Tell a bedtime story about {t}.",
    "Write a 100-word story that begins with someone {t}.",
    "Share three interesting facts about {t}.", "What is something most people don't know about {t}?",
    "Tell me a little about the history of {t}.", "Why do people enjoy {t}?",
    "How would you explain {t} to {a}?", "Describe {t} in simple words for {a}.",
    "List five tips for {t}.", "What is your best advice for {t}?", "How do I get started with {t}?",
    "What do I need to know before {t}?", "What are the advantages and disadvantages of {t}?",
    "What are the most common mistakes with {t}, and how can I avoid them?",
    "Give me a step-by-step plan for {t}.", "Make a one-week plan for {t}.", "What equipment do I need for {t}?",
    "Write an encouraging message to a friend who is {t}.", "Write a short email to my team about {t}.",
    "Write a friendly note to my neighbour about {t}.", "Write a social media post about {t}.",
    "Suggest five fun ideas related to {t}.", "Brainstorm names for a club about {t}.",
    "Give me a short motivational speech about {t}.", "Describe a perfect day spent {t}.",
    "Write a diary entry from someone who spent the day {t}.",
    "I am {a_plain}. Can you give me some advice about {t}?",
    "Could you summarise the key points about {t} in a few bullet points?",
    "What questions do people often ask about {t}? Answer two of them.",
    "Is {t} worth the effort? Give me an honest answer.",
)
_STANDALONE_TEMPLATES = (
    "Give me a simple recipe for {d}.", "How do I make {d} without an oven?", "What goes well with {d}?",
    "Compare {p} and {q}.", "Which is better, {p} or {q}? Give reasons for both sides.",
    "Write a short funny dialogue between someone who loves {p} and someone who loves {q}.",
)
_CONVERSATION_CLOSINGS = (
    "", "", "", "", " Keep it short.", " Please use a friendly tone.", " Use simple words.", " Answer in a few sentences.",
    " Please answer with a numbered list.", " Make it fun.", " Be practical.",
)


def build_conversation_prompts(count: int, seed: int) -> list[TrainingPrompt]:
    """``count`` distinct prompts of the conversation set, deterministic for ``seed`` (a longer
    list extends a shorter one), ids ``conversation-<index>``. Raises ValueError when the set
    cannot give that many."""
    rng = random.Random(f"sonar-conversation/{seed}")
    seen: set[str] = set()
    prompts: list[TrainingPrompt] = []
    attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > 50 * max(count, 1):
            raise ValueError(f"could not make {count} distinct conversation prompts (made {len(prompts)})")
        text = _conversation(rng)
        if text in seen:
            continue
        seen.add(text)
        prompts.append(TrainingPrompt(f"{CONVERSATION}-{len(prompts):06d}", CONVERSATION,
                                      ({"role": "user", "content": text},)))
    return prompts


def _conversation(rng: random.Random) -> str:
    choice = rng.random()
    if choice < 0.12:
        return rng.choice(_QUESTIONS) + rng.choice(_CONVERSATION_CLOSINGS)
    if choice < 0.25:
        p, q = rng.choice(_PAIRS)
        text = rng.choice(_STANDALONE_TEMPLATES).format(d=rng.choice(_DISHES), p=p, q=q)
        return text + rng.choice(_CONVERSATION_CLOSINGS)
    audience = rng.choice(_AUDIENCES)
    text = rng.choice(_CONVERSATION_TEMPLATES).format(t=rng.choice(_TOPICS), a=audience, a_plain=audience)
    return text + rng.choice(_CONVERSATION_CLOSINGS)
