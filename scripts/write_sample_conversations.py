"""Write the bundled sample conversations (dflash_assets/data/conversations.jsonl), deterministically.

The demo target model's tokenizer and training run read this file, so the output must not change
unless the script does: every choice comes from one seeded `random.Random`. Run from the repo root:

    python scripts/write_sample_conversations.py [OUTPUT]
"""

from __future__ import annotations

import datetime as dt
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

SEED = 20250601
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "dflash_assets" / "data" / "conversations.jsonl"

Conversation = list[dict[str, str]]

SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer clearly and briefly.",
    "You are a patient math tutor. Show each step of your work.",
    "You are a senior software engineer. Prefer short, correct code with a one-line explanation.",
    "You are a concise assistant. Keep answers under five sentences.",
    "You are a friendly science teacher explaining ideas to curious teenagers.",
    "Answer as precisely as you can. If a question is ambiguous, state your assumption.",
]

NAMES = ["Maya", "Liam", "Aisha", "Noah", "Sofia", "Ravi", "Elena", "Kenji", "Zoe", "Omar", "Lucia", "Ben"]


def money(value: float) -> str:
    return f"${value:,.2f}"


def num(value: float) -> str:
    """A number without a pointless trailing '.0'."""
    if abs(value - round(value)) < 1e-9:
        return f"{round(value):,}"
    return f"{value:,.2f}".rstrip("0").rstrip(".")


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# --- arithmetic word problems -------------------------------------------------------------------


def shopping(rng: random.Random) -> Conversation:
    name = rng.choice(NAMES)
    item, unit = rng.choice([("notebooks", 3.25), ("apples", 0.6), ("pencils", 0.45), ("mugs", 7.5)])
    count = rng.randint(3, 12)
    extra_item, extra_price = rng.choice([("a pen", 1.5), ("a bag", 2.0), ("a bottle of water", 1.25)])
    subtotal = count * unit
    total = subtotal + extra_price
    paid = rng.choice([bill for bill in (20, 50, 100) if bill >= total])
    change = paid - total
    question = (
        f"{name} buys {count} {item} at {money(unit)} each and {extra_item} for {money(extra_price)}. "
        f"{name} pays with {money(paid)}. How much change does {name} get?"
    )
    answer = (
        f"First the {item}: {count} × {money(unit)} = {money(subtotal)}.\n"
        f"Add {extra_item}: {money(subtotal)} + {money(extra_price)} = {money(total)}.\n"
        f"Change: {money(paid)} − {money(total)} = {money(change)}.\n\n"
        f"{name} gets {money(change)} back."
    )
    conv = [user(question), assistant(answer)]
    if rng.random() < 0.4:
        new_count = count + rng.randint(2, 5)
        new_total = new_count * unit + extra_price
        conv += [
            user(f"What if {name} bought {new_count} {item} instead?"),
            assistant(
                f"Then the {item} cost {new_count} × {money(unit)} = {money(new_count * unit)}, and with "
                f"{extra_item} the total is {money(new_total)}."
                + (
                    f" The change from {money(paid)} would be {money(paid - new_total)}."
                    if new_total <= paid
                    else f" That is more than {money(paid)}, so {name} would be "
                    f"{money(new_total - paid)} short."
                )
            ),
        ]
    return conv


def speed(rng: random.Random) -> Conversation:
    vehicle = rng.choice(["train", "bus", "cyclist", "car", "ferry"])
    hours = rng.choice([1.5, 2, 2.5, 3, 4, 0.75])
    kmh = rng.choice([12, 18, 24, 40, 60, 72, 80, 96])
    distance = kmh * hours
    question = f"A {vehicle} travels {num(distance)} km in {num(hours)} hours. What is its average speed?"
    answer = (
        f"Average speed = distance ÷ time = {num(distance)} km ÷ {num(hours)} h = {num(kmh)} km/h.\n\n"
        f"The {vehicle} averages {num(kmh)} km/h."
    )
    conv = [user(question), assistant(answer)]
    if rng.random() < 0.5:
        more = rng.choice([30, 45, 90])
        conv += [
            user(f"How far would it go in {more} minutes at that speed?"),
            assistant(
                f"{more} minutes is {num(more / 60)} h, so the distance is {num(kmh)} km/h × "
                f"{num(more / 60)} h = {num(kmh * more / 60)} km."
            ),
        ]
        if rng.random() < 0.5:
            miles = kmh * more / 60 / 1.609344
            conv += [
                user("And in miles?"),
                assistant(
                    f"One mile is 1.609344 km, so {num(kmh * more / 60)} km ÷ 1.609344 ≈ {miles:.1f} miles."
                ),
            ]
    return conv


def discount(rng: random.Random) -> Conversation:
    item = rng.choice(["jacket", "pair of shoes", "lamp", "backpack", "headphones", "board game"])
    price = rng.choice([40, 60, 80, 120, 150, 250])
    pct = rng.choice([10, 15, 20, 25, 30, 40])
    off = price * pct / 100
    sale = price - off
    answer = (
        f"{pct}% of {money(price)} is {num(pct / 100)} × {money(price)} = {money(off)}.\n"
        f"Sale price: {money(price)} − {money(off)} = {money(sale)}."
    )
    conv = [
        user(f"A {item} costs {money(price)} and is {pct}% off. What is the sale price?"),
        assistant(answer),
    ]
    if rng.random() < 0.4:
        tax = rng.choice([5, 8, 10])
        conv += [
            user(f"Now add {tax}% sales tax to the sale price."),
            assistant(
                f"Tax: {num(tax / 100)} × {money(sale)} = {money(sale * tax / 100)}.\n"
                f"Total: {money(sale)} + {money(sale * tax / 100)} = {money(sale * (1 + tax / 100))}."
            ),
        ]
    return conv


def sharing(rng: random.Random) -> Conversation:
    things = rng.choice(["cookies", "stickers", "marbles", "tickets", "pencils"])
    kids = rng.randint(3, 9)
    total = rng.randint(kids * 3, kids * 12)
    each, left = divmod(total, kids)
    answer = (
        f"Divide {total} by {kids}: {kids} × {each} = {kids * each}, and {total} − {kids * each} "
        f"= {left}.\n\n"
        f"Each child gets {each} {things}"
        + (f", and {left} {'is' if left == 1 else 'are'} left over." if left else " with none left over.")
    )
    question = f"There are {total} {things} shared equally among {kids} children. How many does each get?"
    return [user(question), assistant(answer)]


def rectangle(rng: random.Random) -> Conversation:
    place = rng.choice(["garden", "room", "playground", "parking lot", "classroom floor"])
    width = rng.randint(3, 20)
    length = width + rng.randint(1, 15)
    area = width * length
    perimeter = 2 * (width + length)
    conv = [
        user(
            f"A rectangular {place} is {length} m long and {width} m wide. What are its area and perimeter?"
        ),
        assistant(
            f"Area = length × width = {length} × {width} = {area} m².\n"
            f"Perimeter = 2 × (length + width) = 2 × ({length} + {width}) = {perimeter} m."
        ),
    ]
    if rng.random() < 0.5:
        cost = rng.choice([3, 4.5, 6, 12])
        conv += [
            user(f"Fencing costs {money(cost)} per metre. How much to fence it?"),
            assistant(
                f"The fence runs along the perimeter: {perimeter} m × {money(cost)} = "
                f"{money(perimeter * cost)}."
            ),
        ]
    return conv


def average(rng: random.Random) -> Conversation:
    name = rng.choice(NAMES)
    scores = [rng.randint(55, 100) for _ in range(rng.randint(3, 6))]
    total = sum(scores)
    mean = total / len(scores)
    listed = ", ".join(str(s) for s in scores)
    conv = [
        user(f"{name} scored {listed} on {len(scores)} tests. What is the average score?"),
        assistant(
            f"Sum: {' + '.join(str(s) for s in scores)} = {total}.\n"
            f"Average: {total} ÷ {len(scores)} = {mean:.2f}.\n\n"
            f"The average is {num(round(mean, 2))}."
        ),
    ]
    if rng.random() < 0.45:
        target = min(100, math.ceil(mean) + rng.randint(2, 6))
        needed = target * (len(scores) + 1) - total
        reply = (
            f"To average {target} over {len(scores) + 1} tests the total must be {target} × "
            f"{len(scores) + 1} = {target * (len(scores) + 1)}. {name} has {total}, so the next test needs "
            f"{target * (len(scores) + 1)} − {total} = {needed}."
        )
        reply += " That is possible." if needed <= 100 else " That is more than 100, so it is not possible."
        conv += [user(f"What score does {name} need on the next test to average {target}?"), assistant(reply)]
    return conv


def clock(rng: random.Random) -> Conversation:
    event = rng.choice(["movie", "concert", "flight", "train ride", "workshop"])
    start = dt.datetime(2024, 1, 1, rng.randint(8, 20), rng.choice([0, 10, 15, 30, 45, 50]))
    minutes = rng.choice([50, 85, 95, 110, 140, 165, 200])
    end = start + dt.timedelta(minutes=minutes)
    hours, rest = divmod(minutes, 60)
    span = f"{hours} h {rest} min" if hours else f"{rest} min"
    question = f"A {event} starts at {start:%H:%M} and lasts {span}. When does it end?"
    if hours:
        after_hours = start + dt.timedelta(hours=hours)
        answer = f"{start:%H:%M} + {hours} h = {after_hours:%H:%M}, then + {rest} min = {end:%H:%M}."
    else:
        answer = f"{start:%H:%M} + {rest} min = {end:%H:%M}."
    return [user(question), assistant(f"{answer}\n\nIt ends at {end:%H:%M}.")]


def interest(rng: random.Random) -> Conversation:
    principal = rng.choice([500, 1000, 2500, 4000, 10000])
    rate = rng.choice([2, 3, 4, 5, 6])
    years = rng.randint(2, 6)
    simple = principal * rate / 100 * years
    compound = principal * (1 + rate / 100) ** years - principal
    conv = [
        user(
            f"How much simple interest does {money(principal)} earn at {rate}% per year over {years} years?"
        ),
        assistant(
            f"Simple interest = principal × rate × time = {money(principal)} × {num(rate / 100)} × {years} = "
            f"{money(simple)}."
        ),
    ]
    if rng.random() < 0.6:
        conv += [
            user("And with interest compounded yearly?"),
            assistant(
                f"Compound amount = {money(principal)} × (1 + {num(rate / 100)})^{years} = "
                f"{money(principal + compound)}, so the interest is {money(compound)} — "
                f"{money(compound - simple)} more than simple interest."
            ),
        ]
    return conv


def ages(rng: random.Random) -> Conversation:
    older, younger = rng.sample(NAMES, 2)
    young_age = rng.randint(3, 12)
    factor = rng.randint(2, 4)
    old_age = young_age * factor
    total = old_age + young_age
    answer = (
        f"Let {younger}'s age be x. Then {older} is {factor}x, and x + {factor}x = {total}, so "
        f"{factor + 1}x = {total} and x = {young_age}.\n\n"
        f"{younger} is {young_age} and {older} is {old_age}."
    )
    question = f"{older} is {factor} times as old as {younger}. Together they are {total}. How old is each?"
    return [user(question), assistant(answer)]


# --- conversions ----------------------------------------------------------------------------------

CONVERSIONS = [
    ("kilometres", "miles", 0.621371, "1 km ≈ 0.621371 miles"),
    ("miles", "kilometres", 1.609344, "1 mile = 1.609344 km"),
    ("kilograms", "pounds", 2.204623, "1 kg ≈ 2.204623 lb"),
    ("pounds", "kilograms", 0.453592, "1 lb ≈ 0.453592 kg"),
    ("litres", "US gallons", 0.264172, "1 L ≈ 0.264172 US gallons"),
    ("inches", "centimetres", 2.54, "1 inch = 2.54 cm"),
    ("feet", "metres", 0.3048, "1 foot = 0.3048 m"),
    ("ounces", "grams", 28.349523, "1 oz ≈ 28.35 g"),
    ("gigabytes", "megabytes", 1000, "1 GB = 1000 MB (decimal units)"),
    ("GiB", "MiB", 1024, "1 GiB = 1024 MiB (binary units)"),
]


def conversion(rng: random.Random) -> Conversation:
    src, dst, factor, rule = rng.choice(CONVERSIONS)
    value = rng.choice([1.5, 2, 5, 7.5, 10, 12, 26.2, 42, 100, 250])
    result = value * factor
    phrasing = rng.choice(
        [
            f"Convert {num(value)} {src} to {dst}.",
            f"How many {dst} is {num(value)} {src}?",
            f"{num(value)} {src} in {dst}?",
        ]
    )
    conv = [user(phrasing), assistant(f"{rule}, so {num(value)} × {factor:g} = {result:,.2f} {dst}.")]
    if rng.random() < 0.35:
        conv += [
            user(f"And how many {src} is {num(value)} {dst}?"),
            assistant(
                f"Going the other way you divide: {num(value)} ÷ {factor:g} = {value / factor:,.3f} {src}."
            ),
        ]
    return conv


def temperature(rng: random.Random) -> Conversation:
    if rng.random() < 0.5:
        c = rng.choice([-40, -10, 0, 12, 21, 25, 37, 100, 180])
        f = c * 9 / 5 + 32
        conv = [
            user(rng.choice([f"What is {c} °C in Fahrenheit?", f"Convert {c}°C to °F."])),
            assistant(f"°F = °C × 9/5 + 32 = {c} × 1.8 + 32 = {num(f)} °F."),
        ]
    else:
        f = rng.choice([-40, 0, 32, 50, 68, 72, 98.6, 212, 350])
        c = (f - 32) * 5 / 9
        conv = [
            user(rng.choice([f"What is {num(f)} °F in Celsius?", f"Convert {num(f)}°F to °C."])),
            assistant(f"°C = (°F − 32) × 5/9 = ({num(f)} − 32) × 5/9 = {c:.1f} °C."),
        ]
    if rng.random() < 0.3:
        conv += [
            user("Is there a temperature where both scales read the same?"),
            assistant(
                "Yes: −40. Setting x = x × 9/5 + 32 gives −4x/5 = 32, so x = −40, and −40 °C = −40 °F."
            ),
        ]
    return conv


def duration(rng: random.Random) -> Conversation:
    seconds = rng.choice([90, 3600, 5400, 7325, 86400, 100000, 45296])
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return [
        user(f"How long is {seconds:,} seconds in hours, minutes and seconds?"),
        assistant(
            f"{seconds:,} ÷ 3600 = {hours} h with {rest} s left; {rest} ÷ 60 = {minutes} min "
            f"with {secs} s left.\n\n"
            f"So {seconds:,} s = {hours} h {minutes} min {secs} s."
        ),
    ]


# --- number facts ---------------------------------------------------------------------------------


def gcd_lcm(rng: random.Random) -> Conversation:
    g = rng.choice([2, 3, 4, 6, 7, 12, 15])
    a, b = g * rng.randint(2, 9), g * rng.randint(10, 19)
    steps, x, y = [], b, a
    while y:
        steps.append(f"{x} = {x // y} × {y} + {x % y}")
        x, y = y, x % y
    conv = [
        user(f"Find the greatest common divisor of {a} and {b}."),
        assistant("Using Euclid's algorithm:\n" + "\n".join(steps) + f"\n\nThe GCD is {x}."),
    ]
    if rng.random() < 0.5:
        conv += [
            user("And their least common multiple?"),
            assistant(f"LCM = a × b ÷ GCD = {a} × {b} ÷ {x} = {a * b // x}."),
        ]
    return conv


def prime(rng: random.Random) -> Conversation:
    n = rng.choice([29, 51, 57, 89, 91, 97, 119, 121, 127, 143, 151, 169, 187, 199, 221])
    limit = math.isqrt(n)
    divisor = next((d for d in range(2, limit + 1) if n % d == 0), None)
    if divisor is None:
        answer = f"Check divisors up to √{n} ≈ {math.sqrt(n):.1f}: none of 2..{limit} divides {n}.\n\n"
        answer += f"{n} is prime."
    else:
        answer = f"{n} = {divisor} × {n // divisor}, so {n} is not prime."
    return [user(rng.choice([f"Is {n} a prime number?", f"Is {n} prime?"])), assistant(answer)]


def binary(rng: random.Random) -> Conversation:
    n = rng.randint(5, 255)
    steps, x = [], n
    while x:
        steps.append(f"{x} ÷ 2 = {x // 2} remainder {x % 2}")
        x //= 2
    conv = [
        user(f"Convert {n} to binary."),
        assistant(
            "Divide by 2 repeatedly and read the remainders from bottom to top:\n"
            + "\n".join(steps)
            + f"\n\n{n} = 0b{n:b}."
        ),
    ]
    if rng.random() < 0.4:
        conv += [user("What is it in hexadecimal?"), assistant(f"Group the bits in fours: {n:b} → 0x{n:X}.")]
    return conv


# --- words ----------------------------------------------------------------------------------------

WORDS = [
    "banana", "mississippi", "keyboard", "algorithm", "elephant", "strawberry", "rhythm", "queue",
    "bookkeeper", "committee", "parallel", "necessary", "umbrella", "giraffe", "syzygy", "onomatopoeia",
]  # fmt: skip


def letters(rng: random.Random) -> Conversation:
    word = rng.choice(WORDS)
    kind = rng.randint(0, 2)
    if kind == 0:
        letter = rng.choice(sorted(set(word)))
        count = word.count(letter)
        positions = ", ".join(str(i + 1) for i, ch in enumerate(word) if ch == letter)
        return [
            user(f'How many times does the letter "{letter}" appear in "{word}"?'),
            assistant(
                f'"{letter}" appears {count} time{"s" if count != 1 else ""} in "{word}" '
                f"(position{'s' if count != 1 else ''} {positions})."
            ),
        ]
    if kind == 1:
        return [user(f'Spell "{word}" backwards.'), assistant(f'"{word}" backwards is "{word[::-1]}".')]
    vowels = [ch for ch in word if ch in "aeiou"]
    return [
        user(f'How many vowels are in "{word}"?'),
        assistant(f'"{word}" has {len(vowels)} vowels: {", ".join(vowels) if vowels else "none"}.'),
    ]


def sort_words(rng: random.Random) -> Conversation:
    words = rng.sample(WORDS, rng.randint(4, 7))
    conv = [
        user("Sort these words alphabetically: " + ", ".join(words) + "."),
        assistant(", ".join(sorted(words)) + "."),
    ]
    if rng.random() < 0.5:
        conv += [
            user("Now sort them by length, shortest first."),
            assistant(", ".join(sorted(words, key=lambda w: (len(w), w))) + "."),
        ]
    return conv


# --- dates ----------------------------------------------------------------------------------------


def dates(rng: random.Random) -> Conversation:
    start = dt.date(2024, 1, 1) + dt.timedelta(days=rng.randint(0, 700))
    days = rng.choice([10, 30, 45, 90, 100, 180, 365])
    end = start + dt.timedelta(days=days)
    conv = [
        user(f"What date is {days} days after {start:%B} {start.day}, {start.year}?"),
        assistant(
            f"{days} days after {start:%B} {start.day}, {start.year} is {end:%A}, {end:%B} "
            f"{end.day}, {end.year}."
        ),
    ]
    if rng.random() < 0.4:
        conv += [
            user(f"What day of the week was {start:%B} {start.day}, {start.year}?"),
            assistant(f"It was a {start:%A}."),
        ]
    return conv


# --- code -----------------------------------------------------------------------------------------

# (request, language, code, explanation, complexity, test)
CODE_SNIPPETS = [
    (
        "reverse a string",
        "python",
        "def reverse(text: str) -> str:\n    return text[::-1]",
        "Slicing with a step of -1 walks the string from the end to the start.",
        "O(n) time and O(n) extra space for the new string.",
        'assert reverse("abc") == "cba"\nassert reverse("") == ""',
    ),
    (
        "check whether a number is prime",
        "python",
        "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n    d = 2\n    "
        "while d * d <= n:\n"
        "        if n % d == 0:\n            return False\n        d += 1\n    return True",
        "It only tries divisors up to √n, because a larger factor would pair with a smaller one.",
        "O(√n) time, O(1) space.",
        "assert is_prime(2) and is_prime(97)\nassert not is_prime(1) and not is_prime(91)",
    ),
    (
        "compute the n-th Fibonacci number",
        "python",
        "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a "
        "+ b\n    return a",
        "It keeps only the last two values instead of recursing, so it is fast even for large n.",
        "O(n) additions and O(1) space.",
        "assert [fib(i) for i in range(8)] == [0, 1, 1, 2, 3, 5, 8, 13]",
    ),
    (
        "count how often each word appears in a text",
        "python",
        "from collections import Counter\n\ndef word_counts(text: str) -> Counter:\n"
        "    return Counter(text.lower().split())",
        "Counter builds a dictionary from word to count; lower() makes the count case-insensitive.",
        "O(n) in the length of the text.",
        'assert word_counts("a b A")["a"] == 2',
    ),
    (
        "do a binary search in a sorted list",
        "python",
        "def binary_search(items: list[int], target: int) -> int:\n    lo, hi = 0, len(items) - 1\n"
        "    while lo <= hi:\n        mid = (lo + hi) // 2\n        if items[mid] == target:\n  "
        "          return mid\n"
        "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
        "    return -1",
        "Each step halves the search window; it returns the index, or -1 when the target is absent.",
        "O(log n) time, O(1) space.",
        "assert binary_search([1, 3, 5, 7], 5) == 2\nassert binary_search([1, 3, 5, 7], 4) == -1",
    ),
    (
        "print FizzBuzz from 1 to 15",
        "python",
        'for i in range(1, 16):\n    if i % 15 == 0:\n        print("FizzBuzz")\n    elif i % 3 == 0:\n'
        '        print("Fizz")\n    elif i % 5 == 0:\n        print("Buzz")\n    else:\n        print(i)',
        "The multiple-of-15 check comes first so it wins over the separate 3 and 5 checks.",
        "O(n) for n numbers.",
        "Run it and check that line 15 prints FizzBuzz and line 9 prints Fizz.",
    ),
    (
        "remove duplicates from a list while keeping order",
        "python",
        "def unique(items: list) -> list:\n    return list(dict.fromkeys(items))",
        "Dictionaries keep insertion order, and dict.fromkeys drops repeated keys.",
        "O(n) time, O(n) space; the items must be hashable.",
        "assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]",
    ),
    (
        "read a JSON file",
        "python",
        "import json\nfrom pathlib import Path\n\ndef load(path: str) -> dict:\n"
        '    return json.loads(Path(path).read_text(encoding="utf-8"))',
        "Reading the text with an explicit encoding avoids surprises on systems whose default is not UTF-8.",
        "O(size of the file).",
        'Write {"a": 1} to a temporary file and assert load(path) == {"a": 1}.',
    ),
    (
        "flatten a list of lists",
        "python",
        "def flatten(rows: list[list]) -> list:\n    return [item for row in rows for item in row]",
        "The nested comprehension reads left to right like two nested for loops.",
        "O(total number of items).",
        "assert flatten([[1, 2], [], [3]]) == [1, 2, 3]",
    ),
    (
        "check if a word is a palindrome",
        "python",
        "def is_palindrome(word: str) -> bool:\n    cleaned = word.lower()\n    return cleaned "
        "== cleaned[::-1]",
        "Lower-casing first means 'Level' counts as a palindrome.",
        "O(n) time and space.",
        'assert is_palindrome("Level")\nassert not is_palindrome("python")',
    ),
    (
        "sum the even numbers in an array",
        "javascript",
        "function sumEven(numbers) {\n  return numbers.filter((n) => n % 2 === 0).reduce((a, b) "
        "=> a + b, 0);\n}",
        "filter keeps the even values and reduce adds them, starting from 0 so an empty array gives 0.",
        "O(n) time.",
        "console.assert(sumEven([1, 2, 3, 4]) === 6);",
    ),
    (
        "debounce a function",
        "javascript",
        "function debounce(fn, ms) {\n  let timer;\n  return (...args) => {\n    clearTimeout(timer);\n"
        "    timer = setTimeout(() => fn(...args), ms);\n  };\n}",
        "Each call resets the timer, so fn runs only after the calls stop for ms milliseconds.",
        "O(1) per call.",
        "Call the debounced function three times quickly and check that fn ran once.",
    ),
    (
        "find the top 5 customers by total order value",
        "sql",
        "SELECT customer_id, SUM(amount) AS total\nFROM orders\nGROUP BY customer_id\nORDER BY total DESC\n"
        "LIMIT 5;",
        "GROUP BY makes one row per customer, SUM adds their orders and ORDER BY ... DESC puts "
        "the largest first.",
        "One pass over orders plus a sort of the grouped rows.",
        "Insert a few orders for three customers and compare the result with totals computed by hand.",
    ),
    (
        "count rows per day in a table of events",
        "sql",
        "SELECT DATE(created_at) AS day, COUNT(*) AS events\nFROM events\nGROUP BY DATE(created_at)\n"
        "ORDER BY day;",
        "DATE() drops the time part so all events of one day fall into the same group.",
        "One scan of the table; an index on created_at helps when you filter by date.",
        "Insert events on two days and check both counts.",
    ),
    (
        "find the 10 largest files in a directory",
        "bash",
        "find . -type f -printf '%s %p\\n' | sort -rn | head -n 10",
        "find prints each file's size and path, sort -rn orders numerically from largest, head keeps ten.",
        "Dominated by sorting: O(n log n) for n files.",
        "Create files of known sizes with truncate -s and check the order.",
    ),
    (
        "count the lines in every .py file",
        "bash",
        "find . -name '*.py' -print0 | xargs -0 wc -l | sort -n",
        "-print0 and xargs -0 keep file names with spaces intact.",
        "Linear in the total size of the files.",
        "Compare the total with wc -l on a single file you know.",
    ),
    (
        "reverse a vector in place",
        "rust",
        'fn main() {\n    let mut v = vec![1, 2, 3, 4];\n    v.reverse();\n    println!("{:?}", v);\n}',
        "Vec::reverse swaps elements from both ends towards the middle without allocating.",
        "O(n) time, O(1) extra space.",
        "assert_eq!(v, vec![4, 3, 2, 1]);",
    ),
    (
        "sum a slice of integers",
        "go",
        "func Sum(xs []int) int {\n\ttotal := 0\n\tfor _, x := range xs {\n\t\ttotal += "
        "x\n\t}\n\treturn total\n}",
        "range yields index and value; the index is ignored with _.",
        "O(n) time.",
        'if Sum([]int{1, 2, 3}) != 6 { t.Fatal("want 6") }',
    ),
    (
        "merge two sorted lists",
        "python",
        "def merge(a: list[int], b: list[int]) -> list[int]:\n    out, i, j = [], 0, 0\n"
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
        "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n"
        "    return out + a[i:] + b[j:]",
        "Two pointers advance through the lists, always taking the smaller head; leftovers are appended.",
        "O(len(a) + len(b)).",
        "assert merge([1, 4], [2, 3, 5]) == [1, 2, 3, 4, 5]",
    ),
    (
        "group a list of records by a key",
        "python",
        "from collections import defaultdict\n\ndef group_by(records: list[dict], key: str) -> dict:\n"
        "    groups = defaultdict(list)\n    for record in records:\n        "
        "groups[record[key]].append(record)\n"
        "    return dict(groups)",
        "defaultdict(list) creates an empty list the first time a key is seen.",
        "O(n) time.",
        'assert len(group_by([{"k": 1}, {"k": 1}, {"k": 2}], "k")[1]) == 2',
    ),
    (
        "time how long a function takes",
        "python",
        "import time\n\nstart = time.perf_counter()\nresult = work()\nelapsed = time.perf_counter() - start\n"
        'print(f"took {elapsed:.3f} s")',
        "perf_counter is a monotonic high-resolution clock, unlike time.time which can jump.",
        "Negligible overhead.",
        "Time time.sleep(0.1) and check the result is close to 0.1 s.",
    ),
    (
        "parse command-line arguments",
        "python",
        'import argparse\n\nparser = argparse.ArgumentParser()\nparser.add_argument("path")\n'
        'parser.add_argument("--limit", type=int, default=10)\nargs = parser.parse_args()',
        "argparse generates --help and converts --limit to an int for you.",
        "Not relevant here; parsing is instant.",
        'Call parser.parse_args(["data.txt", "--limit", "3"]) and check args.limit == 3.',
    ),
]


def code(rng: random.Random) -> Conversation:
    request, language, snippet, explanation, complexity, test = rng.choice(CODE_SNIPPETS)
    label = {"python": "Python", "javascript": "JavaScript", "sql": "SQL", "bash": "a shell", "rust": "Rust",
             "go": "Go"}[language]  # fmt: skip
    question = rng.choice(
        [
            f"How do I {request} in {label}?",
            f"Write {label} code to {request}.",
            f"Can you show me how to {request}? Use {label}.",
            f"I need to {request} in {label}. What's a clean way?",
        ]
    )
    conv = [user(question), assistant(f"```{language}\n{snippet}\n```\n\n{explanation}")]
    follow_ups = [
        ("What is its complexity?", complexity),
        (
            "How would I test it?",
            f"A quick check:\n\n```{language}\n{test}\n```" if language != "bash" else test,
        ),
        ("Thanks, that works.", "Glad it helped! Let me know if you want it extended."),
    ]
    rng.shuffle(follow_ups)
    for question, answer in follow_ups[: rng.choice([0, 0, 1, 2, 3])]:
        conv += [user(question), assistant(answer)]
    return conv


# --- explanations ---------------------------------------------------------------------------------

# (question, answer, example, one-line summary)
EXPLANATIONS = [
    (
        "Why is the sky blue?",
        "Sunlight contains all colours. Air molecules scatter short wavelengths much more strongly than long "
        "ones (Rayleigh scattering goes as 1/λ⁴), so blue light is scattered across the whole "
        "sky and reaches "
        "your eyes from every direction.",
        "At sunset light crosses much more air, most of the blue is scattered away, and the remaining light "
        "looks orange and red.",
        "Air scatters blue light far more than red, so the sky glows blue.",
    ),
    (
        "How does photosynthesis work?",
        "Plants use light energy, captured by chlorophyll, to turn carbon dioxide and water into glucose and "
        "oxygen: 6 CO₂ + 6 H₂O → C₆H₁₂O₆ + 6 O₂. The light reactions make ATP and NADPH; the Calvin cycle "
        "uses them to fix carbon into sugar.",
        "A leaf in sunlight releases tiny oxygen bubbles if you put it under water.",
        "Plants turn light, water and CO₂ into sugar and oxygen.",
    ),
    (
        "What is a hash table?",
        "A hash table stores key–value pairs in an array. A hash function turns each key into an index, so "
        "looking up, inserting or deleting a key takes constant time on average. Collisions, where two keys "
        "map to the same index, are handled by chaining or probing.",
        "Python's dict is a hash table: d['apple'] = 3 hashes 'apple' to find the slot.",
        "An array indexed by a hash of the key, giving average O(1) lookups.",
    ),
    (
        "What is recursion?",
        "Recursion is when a function solves a problem by calling itself on a smaller version of the same "
        "problem, until it reaches a base case that it can answer directly.",
        "factorial(n) = n × factorial(n − 1), with factorial(0) = 1 as the base case.",
        "A function that calls itself on smaller inputs until a base case.",
    ),
    (
        "What causes the seasons?",
        "Earth's axis is tilted about 23.4° relative to its orbit. For part of the year one hemisphere leans "
        "towards the Sun and gets more direct sunlight and longer days — summer — while the "
        "other gets winter.",
        "In June the northern hemisphere leans towards the Sun, so it is summer in Canada and winter in "
        "Australia.",
        "The tilt of Earth's axis, not its distance from the Sun.",
    ),
    (
        "What is the difference between a process and a thread?",
        "A process is a running program with its own memory space. Threads live inside a process and share "
        "its memory, which makes communication cheap but requires locks to avoid races.",
        "A browser may run each tab as a process, while a single tab uses threads for layout and networking.",
        "Processes have separate memory; threads share their process's memory.",
    ),
    (
        "What is an API?",
        "An application programming interface is a defined set of requests a program accepts and the "
        "responses it returns, so other programs can use it without knowing how it works inside.",
        "A weather service API might accept GET /forecast?city=Oslo and return JSON with temperatures.",
        "A contract for how programs talk to each other.",
    ),
    (
        "How do vaccines work?",
        "A vaccine shows the immune system a harmless piece or version of a pathogen. The body makes "
        "antibodies and memory cells, so if the real pathogen appears later it responds much faster.",
        "The measles vaccine uses a weakened virus that trains immunity without causing the disease.",
        "They train the immune system in advance with a harmless look-alike.",
    ),
    (
        "What is compound interest?",
        "Compound interest is interest earned on both the original amount and on interest already added. "
        "The balance grows as P × (1 + r)^t instead of linearly.",
        "$1,000 at 5% becomes $1,050 after one year and $1,102.50 after two, not $1,100.",
        "Interest on interest, which makes growth exponential.",
    ),
    (
        "What is the difference between weather and climate?",
        "Weather is the state of the atmosphere over hours or days. Climate is the long-term pattern of "
        "weather in a region, usually averaged over 30 years.",
        "A cold day in July is weather; July being warm on average is climate.",
        "Weather is short-term; climate is the long-term average.",
    ),
    (
        "What does a compiler do?",
        "A compiler translates source code into another form, usually machine code or bytecode, checking "
        "syntax and types along the way and often optimising the result.",
        "gcc turns a C file into an executable that the CPU can run directly.",
        "It translates source code into something a machine can execute.",
    ),
    (
        "Why do we have leap years?",
        "A year is about 365.2422 days. Adding a day every four years fixes most of the drift, and skipping "
        "leap years in century years not divisible by 400 fixes the rest.",
        "2000 was a leap year but 1900 was not.",
        "To keep the calendar aligned with Earth's orbit.",
    ),
    (
        "What is Big O notation?",
        "Big O describes how an algorithm's cost grows with input size, ignoring constant "
        "factors. O(n) grows "
        "linearly, O(n²) quadratically, O(log n) very slowly.",
        "Scanning a list for a value is O(n); binary search on a sorted list is O(log n).",
        "A way to describe how running time grows with input size.",
    ),
    (
        "How does a refrigerator keep food cold?",
        "A refrigerant is compressed, which heats it; it releases that heat through coils at "
        "the back. It then "
        "expands through a valve, cools sharply, and absorbs heat from inside the fridge before returning to "
        "the compressor.",
        "The coils on the back of a fridge feel warm because they dump the heat taken from inside.",
        "It pumps heat from inside to outside using a refrigerant cycle.",
    ),
    (
        "What is a database index?",
        "An index is an extra data structure, usually a B-tree, that keeps a column's values sorted with "
        "pointers to the rows, so the database can find matching rows without scanning the whole table.",
        "An index on users(email) makes WHERE email = 'a@b.com' fast.",
        "A sorted lookup structure that speeds up searches at the cost of slower writes.",
    ),
    (
        "What is inflation?",
        "Inflation is the general rise in prices over time, which means each unit of money buys less. It is "
        "usually measured with a price index such as the CPI.",
        "With 3% inflation, a basket costing $100 this year costs about $103 next year.",
        "Rising prices that reduce what money can buy.",
    ),
    (
        "How does GPS find my location?",
        "Satellites broadcast their position and the exact time. Your receiver measures how long signals "
        "from at least four satellites took to arrive and solves for its position and clock error.",
        "Phones combine GPS with Wi-Fi and cell towers to get a fix faster indoors.",
        "By timing signals from several satellites and solving for position.",
    ),
    (
        "What is version control?",
        "Version control records changes to files over time so you can see history, compare versions, undo "
        "mistakes and work on branches that are later merged.",
        "With git, git log shows history and git revert undoes a commit.",
        "A history of changes that lets people collaborate and undo safely.",
    ),
    (
        "What is the difference between RAM and storage?",
        "RAM is fast, temporary memory the CPU works from; it is cleared when power goes off. "
        "Storage (SSD or "
        "disk) is slower but keeps data permanently.",
        "Opening a file copies it from the SSD into RAM so the program can edit it quickly.",
        "RAM is fast and temporary; storage is slower and permanent.",
    ),
    (
        "Why does ice float?",
        "When water freezes, hydrogen bonds lock molecules into an open hexagonal lattice that "
        "takes up about "
        "9% more space than liquid water, so ice is less dense and floats.",
        "Lakes freeze from the top down, which lets fish survive in the liquid water below.",
        "Ice is less dense than liquid water because of its open crystal structure.",
    ),
    (
        "What is machine learning?",
        "Machine learning is building programs that learn patterns from examples instead of following "
        "hand-written rules. A model's parameters are adjusted to reduce its error on training data.",
        "A spam filter learns which words predict spam from thousands of labelled emails.",
        "Programs that learn rules from data.",
    ),
    (
        "What is a language model?",
        "A language model assigns probabilities to sequences of tokens. Given the text so far, it predicts a "
        "distribution over the next token; generating text means sampling from it repeatedly.",
        "After 'The capital of France is', a good model puts most probability on ' Paris'.",
        "A model that predicts the next token from the ones before it.",
    ),
    (
        "What is speculative decoding?",
        "Speculative decoding speeds up generation with a small draft model that proposes several tokens; "
        "the large model checks them all in one forward pass and keeps the longest correct "
        "prefix. The output "
        "matches what the large model alone would produce.",
        "If the drafter proposes 8 tokens and the first 5 are accepted, one large-model pass "
        "yields 6 tokens.",
        "A small model guesses ahead and the big model verifies in parallel.",
    ),
    (
        "What is a tokenizer?",
        "A tokenizer splits text into tokens — words, pieces of words or bytes — and maps each to an integer "
        "id that a model can process. Byte-pair encoding builds its vocabulary by merging frequent pairs.",
        "'unhappiness' might become 'un', 'happ', 'iness'.",
        "It turns text into the integer ids a model reads.",
    ),
    (
        "Why do metals conduct electricity?",
        "In a metal the outer electrons are not tied to single atoms; they form a 'sea' of free "
        "electrons that "
        "move easily when a voltage is applied.",
        "Copper wires carry current because their free electrons drift along the wire.",
        "Free electrons can move through the metal.",
    ),
    (
        "What is the greenhouse effect?",
        "Gases such as CO₂ and water vapour let sunlight through but absorb part of the infrared heat Earth "
        "radiates, re-emitting some back down and keeping the surface warmer than it would otherwise be.",
        "Without it Earth's average temperature would be about −18 °C instead of about 15 °C.",
        "Some gases trap outgoing heat and warm the planet.",
    ),
    (
        "What is HTTP?",
        "HTTP is the protocol browsers and servers use to exchange requests and responses. A request has a "
        "method such as GET or POST, a path and headers; the response has a status code, headers and a body.",
        "Visiting a page sends GET /index.html; the server replies 200 OK with the HTML.",
        "The request–response protocol of the web.",
    ),
    (
        "What is the difference between a list and a tuple in Python?",
        "A list is mutable: you can append, remove and change items. A tuple is immutable, so it can be used "
        "as a dictionary key and signals that the data should not change.",
        "point = (3, 4) is a natural tuple; shopping = ['milk', 'eggs'] is a list you keep editing.",
        "Lists can change; tuples cannot.",
    ),
]


def explanation(rng: random.Random) -> Conversation:
    question, answer, example, summary = rng.choice(EXPLANATIONS)
    conv = [user(question), assistant(answer)]
    follow_ups = [("Can you give me an example?", example), ("Summarize that in one sentence.", summary)]
    rng.shuffle(follow_ups)
    for follow_question, follow_answer in follow_ups[: rng.choice([0, 1, 1, 2])]:
        conv += [user(follow_question), assistant(follow_answer)]
    return conv


# --- assembly -------------------------------------------------------------------------------------

GENERATORS: list[tuple[Callable[[random.Random], Conversation], int]] = [
    (shopping, 30), (speed, 30), (discount, 25), (sharing, 20), (rectangle, 25), (average, 25), (clock, 15),
    (interest, 20), (ages, 15), (conversion, 35), (temperature, 20), (duration, 10), (gcd_lcm, 20),
    (prime, 15), (binary, 15), (letters, 20), (sort_words, 15), (dates, 20), (code, 70), (explanation, 55),
]  # fmt: skip


def build_conversations(seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    conversations = []
    for generate, count in GENERATORS:
        for _ in range(count):
            messages = generate(rng)
            # About one conversation in four carries a system prompt, as real chat logs often do.
            if rng.random() < 0.25:
                messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}, *messages]
            conversations.append({"messages": messages})
    rng.shuffle(conversations)
    return conversations


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    output = Path(args[0]) if args else DEFAULT_OUTPUT
    conversations = build_conversations()
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("w", encoding="utf-8", newline="\n") as handle:
        for conversation in conversations:
            handle.write(json.dumps(conversation, ensure_ascii=False) + "\n")
    multi_turn = sum(1 for c in conversations if sum(m["role"] == "user" for m in c["messages"]) >= 2)
    with_system = sum(1 for c in conversations if c["messages"][0]["role"] == "system")
    print(
        f"wrote {len(conversations)} conversations ({multi_turn} multi-turn, {with_system} with "
        "a system prompt, "
        f"{output.stat().st_size:,} bytes) to {output}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
