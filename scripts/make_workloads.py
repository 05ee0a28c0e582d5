"""Write the benchmark workloads shipped in ``sonar_core/bench/workloads/`` (one JSON line per request).

Everything is made here, offline, from the text below and a fixed seed, so the files are the same
on every machine and can be regenerated and diffed:

- ``code_edit``: a Python file and an edit to make; the answer repeats most of the file (prompt
  lookup and suffix methods should shine).
- ``chat``: open questions; the answer copies little from the prompt (speculation that relies on
  copying should gain little, and must not lose much).
- ``summarize``: a passage and a summarising task; the answer is grounded in the passage.
- ``agent``: multi-turn tool use in which assistant turns repeat across requests (the same JSON
  call shapes, the same tool results quoted back), as an agent loop produces.

Usage: ``python scripts/make_workloads.py [--out DIR] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "sonar_core" / "bench" / "workloads"
SEED = 20240611

# ------------------------------------------------------------------------------------------ code
CODE_FILES = {
    "inventory.py": '''\
def total_value(items):
    total = 0
    for item in items:
        total = total + item["price"] * item["quantity"]
    return total


def low_stock(items, threshold):
    result = []
    for item in items:
        if item["quantity"] < threshold:
            result.append(item["name"])
    return result


def restock(items, name, amount):
    for item in items:
        if item["name"] == name:
            item["quantity"] = item["quantity"] + amount
            return item
    return None
''',
    "temperature.py": '''\
def celsius_to_fahrenheit(c):
    return c * 9 / 5 + 32


def fahrenheit_to_celsius(f):
    return (f - 32) * 5 / 9


def describe(readings):
    lowest = min(readings)
    highest = max(readings)
    average = sum(readings) / len(readings)
    return "min %.1f, max %.1f, mean %.1f" % (lowest, highest, average)


def warm_days(readings, limit):
    days = []
    for index, value in enumerate(readings):
        if value > limit:
            days.append(index)
    return days
''',
    "text_stats.py": '''\
def word_count(text):
    words = text.split()
    return len(words)


def longest_word(text):
    best = ""
    for word in text.split():
        if len(word) > len(best):
            best = word
    return best


def letter_frequency(text):
    counts = {}
    for char in text.lower():
        if char.isalpha():
            if char in counts:
                counts[char] = counts[char] + 1
            else:
                counts[char] = 1
    return counts
''',
    "bank_account.py": '''\
class BankAccount:
    def __init__(self, owner, balance):
        self.owner = owner
        self.balance = balance
        self.history = []

    def deposit(self, amount):
        self.balance = self.balance + amount
        self.history.append(("deposit", amount))

    def withdraw(self, amount):
        if amount > self.balance:
            return False
        self.balance = self.balance - amount
        self.history.append(("withdraw", amount))
        return True

    def statement(self):
        lines = []
        for kind, amount in self.history:
            lines.append("%s: %d" % (kind, amount))
        return "\\n".join(lines)
''',
    "grades.py": '''\
def average(scores):
    return sum(scores) / len(scores)


def letter(score):
    if score >= 90:
        return "A"
    elif score >= 80:
        return "B"
    elif score >= 70:
        return "C"
    elif score >= 60:
        return "D"
    return "F"


def report(students):
    lines = []
    for name, scores in students.items():
        mean = average(scores)
        lines.append(name + ": " + str(round(mean, 1)) + " " + letter(mean))
    return lines
''',
    "shapes.py": '''\
import math


class Circle:
    def __init__(self, radius):
        self.radius = radius

    def area(self):
        return math.pi * self.radius * self.radius

    def perimeter(self):
        return 2 * math.pi * self.radius


class Rectangle:
    def __init__(self, width, height):
        self.width = width
        self.height = height

    def area(self):
        return self.width * self.height

    def perimeter(self):
        return 2 * (self.width + self.height)
''',
    "todo.py": '''\
tasks = []


def add_task(title, priority):
    task = {"title": title, "priority": priority, "done": False}
    tasks.append(task)
    return task


def complete(title):
    for task in tasks:
        if task["title"] == title:
            task["done"] = True
            return True
    return False


def pending():
    result = []
    for task in tasks:
        if not task["done"]:
            result.append(task["title"])
    return result
''',
    "matrix.py": '''\
def zeros(rows, cols):
    result = []
    for i in range(rows):
        result.append([0] * cols)
    return result


def transpose(matrix):
    rows = len(matrix)
    cols = len(matrix[0])
    result = zeros(cols, rows)
    for i in range(rows):
        for j in range(cols):
            result[j][i] = matrix[i][j]
    return result


def add(a, b):
    result = zeros(len(a), len(a[0]))
    for i in range(len(a)):
        for j in range(len(a[0])):
            result[i][j] = a[i][j] + b[i][j]
    return result
''',
    "config_reader.py": '''\
def read_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def get_int(settings, key, default):
    if key in settings:
        return int(settings[key])
    return default


def get_bool(settings, key, default):
    if key in settings:
        return settings[key].lower() in ("1", "true", "yes")
    return default
''',
    "queue.py": '''\
class Queue:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if len(self.items) == 0:
            return None
        return self.items.pop(0)

    def peek(self):
        if len(self.items) == 0:
            return None
        return self.items[0]

    def size(self):
        return len(self.items)
''',
    "primes.py": '''\
def is_prime(n):
    if n < 2:
        return False
    for d in range(2, n):
        if n % d == 0:
            return False
    return True


def primes_below(limit):
    found = []
    for n in range(limit):
        if is_prime(n):
            found.append(n)
    return found


def twin_primes(limit):
    pairs = []
    primes = primes_below(limit)
    for i in range(len(primes) - 1):
        if primes[i + 1] - primes[i] == 2:
            pairs.append((primes[i], primes[i + 1]))
    return pairs
''',
    "library.py": '''\
class Book:
    def __init__(self, title, author, year):
        self.title = title
        self.author = author
        self.year = year
        self.borrowed = False


class Library:
    def __init__(self):
        self.books = []

    def add(self, book):
        self.books.append(book)

    def borrow(self, title):
        for book in self.books:
            if book.title == title and not book.borrowed:
                book.borrowed = True
                return book
        return None

    def by_author(self, author):
        return [book for book in self.books if book.author == author]
''',
}

CODE_EDITS = (
    "Add a docstring to every function and method.",
    "Add type hints to every function signature.",
    "Rename the module-level functions to start with an underscore, and update every call.",
    "Replace the string formatting with f-strings where strings are built.",
    "Add a comment above each function that says what it returns.",
    "Raise a ValueError with a clear message when a function receives an empty list or an invalid value.",
    "Rewrite the loops that build lists as list comprehensions; leave everything else unchanged.",
    "Add a short module docstring at the top of the file.",
)


def code_edit(rng: random.Random, count: int) -> list[dict[str, Any]]:
    pairs = [(name, edit) for name in CODE_FILES for edit in CODE_EDITS]
    rng.shuffle(pairs)
    records = []
    for name, edit in pairs[:count]:
        user = (
            f"Here is `{name}`:\n\n```python\n{CODE_FILES[name]}```\n\n"
            f"{edit} Reply with the complete updated file in one Python code block."
        )
        records.append({"messages": [{"role": "user", "content": user}]})
    return records


# ------------------------------------------------------------------------------------------ chat
CHAT_TEMPLATES = (
    "Give me three practical tips for {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Write a short, cheerful poem about {topic}.",
    "What are the main benefits and drawbacks of {topic}?",
    "I want to get better at {topic}. Where should I start?",
    "Tell me a fun fact about {topic} and why it is surprising.",
)
CHAT_TOPICS = (
    "learning a new language", "growing tomatoes on a balcony", "saving money each month",
    "running a first marathon", "keeping a houseplant alive", "baking bread at home",
    "taking better photos with a phone", "planning a road trip", "sleeping well",
    "public speaking", "birdwatching", "cooking for a large family", "learning to swim",
    "starting a journal", "composting kitchen scraps", "writing a cover letter",
)


def chat(rng: random.Random, count: int) -> list[dict[str, Any]]:
    pairs = [(template, topic) for template in CHAT_TEMPLATES for topic in CHAT_TOPICS]
    rng.shuffle(pairs)
    return [
        {"messages": [{"role": "user", "content": template.format(topic=topic)}]}
        for template, topic in pairs[:count]
    ]


# ------------------------------------------------------------------------------------- summarize
PASSAGES = (
    (
        "The town library",
        "The town library opened its new wing in March after two years of building work. The wing "
        "adds a children's reading room, six study rooms that can be booked online, and a small "
        "workshop with sewing machines and a 3D printer. Funding came from a county grant and from "
        "a local fundraising drive that collected more than forty thousand dollars in donations. "
        "The head librarian said that visits rose by a third in the first month, mostly from "
        "families on weekday afternoons. Opening hours are now extended to eight in the evening "
        "from Monday to Thursday, and volunteers run a homework club on Tuesdays and Thursdays. "
        "The old reading room will close in the summer so that its windows and heating can be "
        "replaced.",
    ),
    (
        "Honeybees in winter",
        "Honeybees do not hibernate. When the temperature drops, the workers gather into a tight "
        "cluster around the queen and shiver their flight muscles to make heat, keeping the centre "
        "of the cluster near thirty-five degrees Celsius. Bees on the cold outer layer slowly rotate "
        "inward so that no single bee stays at the edge for too long. The colony lives on the honey "
        "it stored during summer, and a strong hive may eat twenty kilograms of it before spring. "
        "On mild, sunny days the bees leave the hive for short cleansing flights. Beekeepers help by "
        "reducing the size of the entrance, protecting the hive from wind, and checking its weight "
        "to judge whether the stores will last.",
    ),
    (
        "A change to the bus network",
        "From the first of September the city will replace its twelve radial bus routes with a grid "
        "of eight frequent lines. Buses on the new lines will run every ten minutes from six in the "
        "morning to nine in the evening, and every twenty minutes until midnight. Planners say the "
        "grid means more trips need one transfer, but that waiting times fall so much that most "
        "journeys will be faster overall. Tickets will be valid for ninety minutes on any number of "
        "buses. Residents of the northern hills, where two routes are being merged, have asked for a "
        "direct service to the hospital; the council has agreed to review ridership after six months "
        "and to add a shuttle if demand is high.",
    ),
    (
        "The school garden",
        "Students at Riverside Primary built a vegetable garden on an unused corner of the "
        "playground. Each class looks after one raised bed and chooses what to grow, from carrots "
        "and peas to sunflowers and pumpkins. Teachers use the garden in lessons about plant life "
        "cycles, measuring and weather, and the oldest pupils keep a record of rainfall and harvest "
        "weights in a shared spreadsheet. Parents helped build a rain barrel and a compost bin. The "
        "school kitchen now serves salad from the garden twice a week in early summer. The project "
        "won a regional award for environmental education, and the prize money will pay for a small "
        "greenhouse so that seedlings can be started in late winter.",
    ),
    (
        "Repairing a bicycle puncture",
        "To repair a puncture, first remove the wheel and let out any remaining air. Use two tyre "
        "levers to lift one side of the tyre off the rim, then pull out the inner tube. Pump a little "
        "air into the tube and listen or feel for the leak; holding it under water shows a stream of "
        "bubbles. Roughen the area around the hole with sandpaper, spread a thin layer of glue, wait "
        "until it turns dull, and press the patch on firmly. While the glue sets, run your fingers "
        "carefully around the inside of the tyre to find the thorn or glass that caused the damage. "
        "Refit the tube, push the tyre back onto the rim with your thumbs, and inflate it to the "
        "pressure printed on the tyre wall.",
    ),
    (
        "A new recycling rule",
        "Starting next month, households must separate food waste from general rubbish. Each home "
        "will receive a small kitchen caddy and a larger brown bin with a locking lid, which will be "
        "collected every week. General rubbish will then be collected every two weeks instead of "
        "weekly. The council expects the change to cut the amount of waste sent to landfill by a "
        "quarter and to save about a million dollars a year, because food waste can be turned into "
        "compost and biogas. Compostable liners will be provided free for the first year. Flats with "
        "shared bins will get larger communal food waste containers, and a helpline will answer "
        "questions during the first three months.",
    ),
    (
        "The night sky in August",
        "August is a good month for stargazing in the northern hemisphere. The Perseid meteor shower "
        "peaks around the twelfth, when a patient observer under a dark sky may see fifty or more "
        "meteors an hour after midnight. The meteors are grains of dust left behind by comet "
        "Swift-Tuttle, burning up as Earth passes through its trail. No telescope is needed: the best "
        "view comes from lying back and looking at a wide area of sky, away from street lights, and "
        "letting your eyes adapt for twenty minutes. Saturn is also well placed this month, rising in "
        "the south-east in the evening, and even a small telescope shows its rings.",
    ),
    (
        "A small bakery's first year",
        "Maria opened her bakery last spring with one oven, a borrowed mixer and a menu of four "
        "breads. In the first months she baked through the night and sold out by ten each morning, "
        "so she hired a second baker and added pastries and a simple lunch of soup and sandwiches. "
        "Rising flour and energy prices squeezed her margins in the winter, and she raised prices "
        "slightly while starting a weekly bread subscription that now has two hundred members. The "
        "subscription gives her steady income and lets her plan how much to bake, which has halved "
        "the amount of unsold bread. She plans to offer baking classes on Sunday afternoons.",
    ),
)
SUMMARY_TASKS = (
    "Summarize the passage in two sentences.",
    "List the three most important facts from the passage as bullet points.",
    "Write a one-sentence headline for the passage, then a two-sentence summary.",
)


def summarize(rng: random.Random, count: int) -> list[dict[str, Any]]:
    pairs = [(passage, task) for passage in PASSAGES for task in SUMMARY_TASKS]
    rng.shuffle(pairs)
    records = []
    for (title, text), task in pairs[:count]:
        user = f"{title}\n\n{text}\n\n{task}"
        records.append({"messages": [{"role": "user", "content": user}]})
    return records


# ----------------------------------------------------------------------------------------- agent
AGENT_SYSTEM = (
    "You are a coding assistant that works in a repository through tools. Call one tool per turn by "
    "replying with a single JSON object and nothing else:\n"
    '{"tool": "list_files", "path": "<folder>"}\n'
    '{"tool": "read_file", "path": "<file>"}\n'
    '{"tool": "run_tests", "path": "<test file or folder>"}\n'
    '{"tool": "write_file", "path": "<file>", "content": "<the complete new content>"}\n'
    '{"tool": "finish", "summary": "<what you changed and why>"}\n'
    "Tool results arrive in the next user message, prefixed with RESULT."
)
AGENT_TASKS = (
    ("The test for total_value fails. Fix inventory.py.", "inventory.py", "tests/test_inventory.py",
     "FAILED tests/test_inventory.py::test_total_value - KeyError: 'quantity'"),
    ("Make describe() in temperature.py handle an empty list.", "temperature.py", "tests/test_temperature.py",
     "FAILED tests/test_temperature.py::test_describe_empty - ValueError: min() arg is an empty sequence"),
    ("The queue is slow for large inputs. Speed up Queue.pop in queue.py.", "queue.py", "tests/test_queue.py",
     "3 passed in 0.41s"),
    ("withdraw() in bank_account.py accepts negative amounts. Reject them.", "bank_account.py",
     "tests/test_bank_account.py",
     "FAILED tests/test_bank_account.py::test_negative_withdraw - assert True is False"),
    ("letter() in grades.py gives the wrong grade for 89.5. Fix the rounding.", "grades.py", "tests/test_grades.py",
     "FAILED tests/test_grades.py::test_boundary - AssertionError: 'B' != 'A'"),
    ("get_bool() in config_reader.py should accept 'on' as true.", "config_reader.py", "tests/test_config_reader.py",
     "FAILED tests/test_config_reader.py::test_on_is_true - assert False is True"),
    ("is_prime() in primes.py is too slow for large numbers. Make it faster.", "primes.py", "tests/test_primes.py",
     "5 passed in 2.87s"),
    ("Library.borrow in library.py should be case-insensitive about titles.", "library.py", "tests/test_library.py",
     "FAILED tests/test_library.py::test_borrow_case - AssertionError: None is not a Book"),
)


def _call(tool: str, **fields: str) -> str:
    return json.dumps({"tool": tool, **fields})


def agent_turns(task: tuple[str, str, str, str]) -> list[tuple[str, str]]:
    """The scripted (assistant call, tool result) pairs of one task, in order."""
    _, module, test_file, failure = task
    return [
        (_call("list_files", path="."),
         "RESULT\n" + "\n".join(sorted([module, "README.md", "tests/", "setup.cfg"]))),
        (_call("read_file", path=module), f"RESULT\n{CODE_FILES[module]}"),
        (_call("run_tests", path=test_file), f"RESULT\n{failure}"),
        (_call("read_file", path=test_file),
         f"RESULT\nfrom {module[:-3]} import *\n\n\ndef test_case():\n    ...  # see the failure above\n"),
    ]


def agent(rng: random.Random, count: int) -> list[dict[str, Any]]:
    """Each request is one task's conversation cut after a tool result: the model is asked for its
    next call. Every task appears at several depths, so earlier turns recur across requests."""
    prefixes = []
    for task in AGENT_TASKS:
        turns = agent_turns(task)
        for depth in range(1, len(turns) + 1):
            messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": task[0]}]
            for call, result in turns[:depth]:
                messages.append({"role": "assistant", "content": call})
                messages.append({"role": "user", "content": result})
            prefixes.append({"messages": messages})
    rng.shuffle(prefixes)
    return prefixes[:count]


WORKLOADS = {
    "code_edit": (code_edit, 32, "Edit a Python file and reply with the whole file: the output copies the input."),
    "chat": (chat, 32, "Open questions: the output copies little from the prompt."),
    "summarize": (summarize, 24, "Summarise a passage: the output is grounded in the input."),
    "agent": (agent, 32, "Multi-turn tool calls: responses repeat across requests."),
}


def build(seed: int) -> dict[str, list[dict[str, Any]]]:
    """Every workload's records, each with an ``id``, the ``workload`` name and chat ``messages``."""
    built = {}
    for offset, (name, (make, count, _)) in enumerate(sorted(WORKLOADS.items())):
        records = make(random.Random(seed + offset), count)
        built[name] = [{"id": f"{name}-{index:03d}", "workload": name, **record} for index, record in enumerate(records)]
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"Folder for the .jsonl files (default: {DEFAULT_OUT}).")
    parser.add_argument("--seed", type=int, default=SEED, help=f"Seed of the shuffles (default: {SEED}).")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, records in build(args.seed).items():
        path = args.out / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as handle:
            header = {"workload": name, "description": WORKLOADS[name][2], "seed": args.seed}
            handle.write(json.dumps({"meta": header}) + "\n")
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"{path}: {len(records)} requests")


if __name__ == "__main__":
    main()
