#!/usr/bin/env python3
"""Writes realistic synthetic recipe JSONL for demos, tests and benchmarks; deterministic by seed, any size.

    scripts/make_demo_data.py --form seq2seq --records 1000000 --seed 1 --out data/recipes-1m.jsonl

seq2seq records: {"input": "...", "target": "..."}; causal: {"prompt": "...", "completion": "..."};
text: {"text": "..."}; chat: {"messages": [...]} conversations of two assistant turns, about a third of them
calling a kitchen-timer tool ({"tools": [...]}, assistant "tool_calls", a "tool" reply); preference: DPO pairs in
TRL's formats, the chosen answer the recipe's real steps and the rejected one steps that skip or scramble them:
standard ({"prompt", "chosen", "rejected"} strings), conversational (lists of messages) and implicit-prompt
({"chosen", "rejected"} whole conversations), about a third each. Streams to the file, so a million records need no
memory.

    scripts/make_demo_data.py --form chat --records 300 --seed 3 --out data/demo/chat.jsonl
    scripts/make_demo_data.py --form preference --records 240 --seed 5 --out data/demo/preferences.jsonl
"""
import argparse
import gzip
import json
import random
import sys

DISHES = ["soup", "stew", "salad", "pie", "bread", "curry", "risotto", "pancakes", "tart", "casserole",
          "dumplings", "noodles", "omelette", "chili", "gratin", "muffins", "flatbread", "porridge"]
ADJECTIVES = ["smoky", "creamy", "spicy", "rustic", "lemony", "golden", "hearty", "crispy", "summer",
              "winter", "garlicky", "herbed", "sweet", "tangy", "grandma's", "quick", "one-pot"]
INGREDIENTS = ["flour", "sugar", "eggs", "butter", "milk", "salt", "pepper", "olive oil", "garlic", "onion",
               "tomatoes", "carrots", "potatoes", "rice", "lentils", "chickpeas", "spinach", "mushrooms",
               "lemon juice", "cumin", "paprika", "thyme", "basil", "parmesan", "cream", "yogurt", "honey",
               "chicken stock", "ginger", "soy sauce", "coconut milk", "cinnamon", "apples", "oats"]
UNITS = ["cup", "cups", "tbsp", "tsp", "g", "ml", "pinch of", "handful of", "cloves of", "cans of"]
VERBS = ["Chop", "Dice", "Whisk", "Stir", "Simmer", "Bake", "Fry", "Roast", "Fold", "Season", "Knead",
         "Blend", "Grate", "Toast", "Boil", "Drain", "Mix", "Pour", "Sprinkle", "Rest"]
TIMES = ["2 minutes", "5 minutes", "10 minutes", "15 minutes", "20 minutes", "half an hour", "1 hour"]
TEMPS = ["180C", "200C", "220C", "350F", "400F", "a low heat", "a medium heat", "a high heat"]


def recipe(rng):
    title = f"{rng.choice(ADJECTIVES)} {rng.choice(INGREDIENTS)} {rng.choice(DISHES)}".capitalize()
    items = rng.sample(INGREDIENTS, rng.randint(3, 9))
    quantities = [f"{rng.randint(1, 4)} {rng.choice(UNITS)} {item}" for item in items]
    steps = []
    for i in range(rng.randint(2, 7)):
        verb = rng.choice(VERBS)
        item = rng.choice(items)
        tail = rng.choice([f"for {rng.choice(TIMES)}", f"at {rng.choice(TEMPS)}", "until golden",
                           "until smooth", "gently", f"with the {rng.choice(items)}"])
        steps.append(f"{i + 1}. {verb} the {item} {tail}.")
    return title, quantities, steps


TIMER_TOOL = {"type": "function", "function": {
    "name": "set_timer", "description": "Start a kitchen timer.",
    "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]}}}


def conversation(rng, title, quantities, steps):
    dish = title.lower()
    if rng.random() < 0.35:
        minutes = rng.choice([5, 10, 15, 20, 30, 45])
        return {"tools": [TIMER_TOOL], "messages": [
            {"role": "user", "content": f"Start a timer for the {dish}: {minutes} minutes."},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "set_timer", "arguments": {"minutes": minutes}}}]},
            {"role": "tool", "content": json.dumps({"timer": "started", "minutes": minutes})},
            {"role": "assistant", "content": f"The timer is set for {minutes} minutes. {steps[-1]}"}]}
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": "You are a helpful cooking assistant."})
    messages += [{"role": "user", "content": f"What goes into {dish}?"},
                 {"role": "assistant", "content": f"{title} needs {', '.join(quantities)}."},
                 {"role": "user", "content": "And the steps?"},
                 {"role": "assistant", "content": " ".join(steps)}]
    return {"messages": messages}


def preference(rng, title, quantities, steps):
    good = " ".join(steps)
    shuffled = steps[:]
    rng.shuffle(shuffled)
    bad = rng.choice([" ".join(shuffled[:max(1, len(shuffled) // 2)]), "Just cook it until done.",
                      f"Put everything in a pot at {rng.choice(TEMPS)} and wait."])
    question = f"How do I make {title.lower()} with {', '.join(quantities)}?"
    kind = rng.random()
    if kind < 0.34:
        return {"prompt": f"Recipe: {title}\nIngredients: {', '.join(quantities)}\nSteps:",
                "chosen": " " + good, "rejected": " " + bad}
    user = {"role": "user", "content": question}
    if kind < 0.67:
        return {"prompt": [user], "chosen": [{"role": "assistant", "content": good}],
                "rejected": [{"role": "assistant", "content": bad}]}
    return {"chosen": [user, {"role": "assistant", "content": good}],
            "rejected": [user, {"role": "assistant", "content": bad}]}


def record(rng, form):
    title, quantities, steps = recipe(rng)
    if form == "preference":
        return preference(rng, title, quantities, steps)
    if form == "chat":
        return conversation(rng, title, quantities, steps)
    if form == "seq2seq":
        return {"input": f"Write the steps for {title}. Ingredients: {', '.join(quantities)}.",
                "target": " ".join(steps)}
    if form == "causal":
        return {"prompt": f"Recipe: {title}\nIngredients: {', '.join(quantities)}\nSteps:",
                "completion": " " + " ".join(steps)}
    return {"text": f"{title}\nIngredients: {', '.join(quantities)}\n" + "\n".join(steps)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--form", choices=["seq2seq", "causal", "text", "chat", "preference"], default="seq2seq")
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="-", help="output file (.gz compresses); - for stdout")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    if args.out == "-":
        out = sys.stdout
    elif args.out.endswith(".gz"):
        out = gzip.open(args.out, "wt", encoding="utf-8")
    else:
        out = open(args.out, "w", encoding="utf-8")
    with out:
        for _ in range(args.records):
            out.write(json.dumps(record(rng, args.form), ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
