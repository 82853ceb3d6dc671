"""Grade-school word problems made from templates: a training source for math that is not an eval source and needs
no download.

A third of the held-out set is GSM8K test, whose answers restate the prompt's names, numbers and units. GSM8K's
train split is the natural training source for it but is not offline (the hub, or a local file), and the default
recipe trained without any math at all drafts GSM8K at 0.69x prompt lookup against 0.95x with GSM8K train in its mix
(benchmarks/README.md, "The default recipe, end to end"). This source writes multi-step word problems of the same
kind (shopping and change, rates and time, fractions, percentages, ages, wages, recipes scaled, legs on a farm, ...)
with varied names, things, units and numbers; the target works them out in its own words, as it does a GSM8K
question. The numbers are chosen so that each step comes out whole (but for one change of units).

Deterministic: problem i is drawn from a generator seeded by its id, so the same count gives the same prompts in the
same order, and a prefix of a longer list is the shorter list; a recipe's seed then picks and orders them like any
source read whole (data/sources/prompts.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from data.sources.rows import Prompt

__all__ = ["COUNT", "word_problems"]

#: how many problems the source holds: more than any recipe here draws (a 1 : 1 : 1 mix of 3 x 10^4 prompts)
COUNT = 20_000

_NAMES = """Aisha Ben Carla Dmitri Elena Farid Grace Hiro Ines Jamal Keiko Liam Maya Nadia Omar Priya Quinn Rosa Sami
Tara Umar Vera Wes Ximena Yusuf Zoe Alma Bruno Chloe Diego Emeka Fatima Gita Hannah Ivan Julia Kofi Lena Marco Nia
Oscar Paula Rahul Sofia Tomas Uma Victor Wendy Yara Zane""".split()
_FOODS = [("apple", "apples"), ("orange", "oranges"), ("muffin", "muffins"), ("cookie", "cookies"),
          ("sandwich", "sandwiches"), ("pear", "pears"), ("cupcake", "cupcakes"), ("banana", "bananas"),
          ("pie", "pies"), ("bagel", "bagels")]
_BAKED = ["muffins", "cookies", "cupcakes", "pies", "bagels"]
_THINGS = [("notebook", "notebooks"), ("pencil", "pencils"), ("marble", "marbles"), ("sticker", "stickers"),
           ("toy car", "toy cars"), ("book", "books"), ("candle", "candles"), ("shirt", "shirts"),
           ("comic", "comics"), ("puzzle", "puzzles"), ("stamp", "stamps"), ("seashell", "seashells")]
_ANIMALS = [("chicken", "chickens"), ("duck", "ducks"), ("cow", "cows"), ("sheep", "sheep"), ("goat", "goats"),
            ("horse", "horses"), ("pig", "pigs"), ("goose", "geese")]  # legs: the target knows them
_PLANTS = ["tomato plants", "rose bushes", "carrots", "sunflowers", "pepper plants", "tulips", "lettuce heads"]
_VEHICLES = [("car", "kilometres"), ("train", "kilometres"), ("bike", "miles"), ("bus", "miles"), ("boat", "miles")]
_BIG_BUYS = ["bicycle", "video game", "pair of shoes", "guitar", "tablet", "skateboard", "telescope", "tent"]


def _names(rng: random.Random, k: int) -> list[str]:
    return rng.sample(_NAMES, k)


def _shopping(r: random.Random) -> str:
    name, many, many2 = _names(r, 1)[0], r.choice(_FOODS)[1], r.choice(_THINGS)[1]
    a, b, p, q = r.randint(2, 9), r.randint(2, 6), r.randint(1, 6), r.randint(2, 12)
    cost = a * p + b * q
    bill = next(x for x in (10, 20, 50, 100, 200) if x > cost)
    return (f"{name} buys {a} {many} for ${p} each and {b} {many2} for ${q} each. {name} pays with a ${bill} bill. "
            f"How much change does {name} get back?")


def _reading(r: random.Random) -> str:
    name = _names(r, 1)[0]
    per_day, days = r.randint(5, 40), r.randint(2, 9)
    total = per_day * days + r.randint(10, 200)
    return (f"{name} is reading a book with {total} pages. {name} reads {per_day} pages every day. "
            f"How many pages are left to read after {days} days?")


def _fraction_gift(r: random.Random) -> str:
    giver, taker = _names(r, 2)
    many = r.choice(_THINGS)[1]
    part = r.choice([2, 3, 4, 5])
    n = part * r.randint(3, 15)
    more = r.randint(2, 20)
    frac = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth"}[part]
    return (f"{giver} had {n} {many}. {giver} gave {frac} of them to {taker} and then bought {more} more. "
            f"How many {many} does {giver} have now?")


def _discount(r: random.Random) -> str:
    name = _names(r, 1)[0]
    one, many = r.choice(_THINGS)
    pct = r.choice([10, 20, 25, 50])
    price = r.choice([4, 8, 12, 20, 40, 60]) * (100 // pct if pct in (25, 50) else 5)
    k = r.randint(2, 6)
    return (f"A {one} normally costs ${price}. This week every {one} is {pct}% off. How much does {name} pay for "
            f"{k} {many} this week?")


def _trip(r: random.Random) -> str:
    name = _names(r, 1)[0]
    vehicle, unit = r.choice(_VEHICLES)
    v1, v2, h1, h2 = r.randint(3, 12) * 5, r.randint(3, 12) * 5, r.randint(2, 5), r.randint(2, 4)
    return (f"{name} travels by {vehicle} at {v1} {unit} per hour for {h1} hours, then at {v2} {unit} per hour for "
            f"{h2} more hours. How many {unit} does {name} travel in all?")


def _farm(r: random.Random) -> str:
    (o1, m1), (o2, m2) = r.sample(_ANIMALS, 2)
    a, b = r.randint(3, 40), r.randint(3, 40)
    name = _names(r, 1)[0]
    return (f"{name}'s farm has {a} {m1 if a > 1 else o1} and {b} {m2 if b > 1 else o2}. "
            f"How many legs do the animals on the farm have altogether?")


def _wages(r: random.Random) -> str:
    name = _names(r, 1)[0]
    w, h, d, k = r.randint(8, 30), r.randint(2, 8), r.randint(2, 6), r.randint(2, 5)
    return (f"{name} earns ${w} an hour and works {h} hours a day, {d} days a week. How much money does {name} "
            f"earn in {k} weeks?")


def _ages(r: random.Random) -> str:
    young, old = _names(r, 2)
    a, k, y = r.randint(3, 15), r.randint(2, 4), r.randint(2, 12)
    return f"{young} is {a} years old. {old} is {k} times as old as {young}. How old will {old} be in {y} years?"


def _saving(r: random.Random) -> str:
    name, thing = _names(r, 1)[0], r.choice(_BIG_BUYS)
    s, weeks, have = r.randint(3, 25), r.randint(4, 20), r.randint(1, 5) * 10
    return (f"{name} wants to buy a {thing} that costs ${s * weeks + have}. {name} already has ${have} and saves "
            f"${s} every week. How many weeks will it take {name} to have enough money?")


def _recipe(r: random.Random) -> str:
    many = r.choice(_BAKED)
    cups, batch, times = r.randint(1, 4), r.choice([6, 8, 10, 12, 24]), r.randint(2, 6)
    return (f"A recipe uses {cups} cups of flour to make {batch} {many}. How many cups of flour are "
            f"needed to make {batch * times} {many}?")


def _classroom(r: random.Random) -> str:
    pct = r.choice([20, 25, 40, 50, 60, 75])
    n = r.choice([20, 40, 60, 80, 100]) if pct in (20, 40, 60) else r.choice([20, 24, 28, 32, 36, 40])
    return (f"There are {n} students in a class, and {pct}% of them walk to school. The rest come by bus. "
            f"How many students come by bus?")


def _boxes(r: random.Random) -> str:
    name = _names(r, 1)[0]
    many = r.choice(_BAKED)
    k, boxes, price = r.choice([4, 6, 8, 12]), r.randint(3, 20), r.randint(3, 15)
    return (f"{name} baked {k * boxes} {many} and packed them in boxes of {k}. {name} sold every box for ${price}. "
            f"How much money did {name} make?")


def _garden(r: random.Random) -> str:
    name, plant = _names(r, 1)[0], r.choice(_PLANTS)
    rows, per_row = r.randint(3, 12), r.randint(4, 15)
    lost = r.randint(1, rows * per_row // 3)
    return (f"{name} planted {rows} rows of {plant} with {per_row} in each row. A storm destroyed {lost} of them. "
            f"How many {plant} are left?")


def _tickets(r: random.Random) -> str:
    adult, child = r.randint(8, 25), r.randint(3, 12)
    a, c = r.randint(2, 4), r.randint(2, 6)
    name = _names(r, 1)[0]
    place = r.choice(["the zoo", "the museum", "the aquarium", "a concert", "the fair"])
    return (f"Tickets to {place} cost ${adult} for an adult and ${child} for a child. {name} buys tickets for {a} "
            f"adults and {c} children. How much does {name} spend on tickets?")


def _compare(r: random.Random) -> str:
    a, b, c = _names(r, 3)
    many = r.choice(_THINGS)[1]
    n, more = r.randint(5, 30), r.randint(2, 20)
    if (n + more) % 2:
        more += 1
    return (f"{a} has {n} {many}. {b} has {more} more {many} than {a}, and {c} has half as many as {b}. "
            f"How many {many} do the three of them have in total?")


def _water(r: random.Random) -> str:
    name = _names(r, 1)[0]
    glasses, ml, weeks = r.randint(4, 10), r.choice([200, 250, 300]), r.randint(1, 4)
    return (f"{name} drinks {glasses} glasses of water every day, and each glass holds {ml} millilitres. How many "
            f"litres of water does {name} drink in {weeks} weeks?")  # a unit change: tenths or hundredths of a litre


#: one template a problem, picked uniformly: each a different kind of step (GSM8K's mix of arithmetic stories)
_TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping, _reading, _fraction_gift, _discount, _trip, _farm, _wages, _ages, _saving, _recipe, _classroom,
    _boxes, _garden, _tickets, _compare, _water)


def word_problems(source: str = "wordmath", count: int = COUNT) -> list[Prompt]:
    """The first `count` problems, one user turn each, id f"{source}:{i}"."""
    out = []
    for i in range(count):
        rng = random.Random(f"wordmath:{i}")  # str seeds hash with sha512: the same problems on every run
        out.append(Prompt(f"{source}:{i}", (rng.choice(_TEMPLATES)(rng),), None, source))
    return out
