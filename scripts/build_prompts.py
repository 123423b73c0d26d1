"""Rebuild prompts.json: hand-written chat prompts by category, with a fixed seeded train/eval split.

Run: .venv/bin/python scripts/build_prompts.py  (rewrites minispec/data/prompts.json in place)
"""
from __future__ import annotations

import json
import random

EVAL_FRACTION = 0.2
SEED = 20240613

# Each category: a list of subjects and a list of phrasings; subject i takes phrasing i % len(phrasings),
# so every prompt reads naturally and no two are the same.
EXPLAIN_TOPICS = [
    "photosynthesis", "how vaccines train the immune system", "inflation", "black holes",
    "the water cycle", "compound interest", "how a refrigerator keeps food cold", "plate tectonics",
    "why the sky is blue", "how the internet routes a message", "supply and demand",
    "how batteries store energy", "the greenhouse effect", "natural selection", "how GPS finds your location",
    "what a neural network is", "how a bill becomes law in a parliament", "the placebo effect",
    "why leaves change colour in autumn", "how credit scores work", "the difference between weather and climate",
    "how noise-cancelling headphones work", "what DNA does in a cell", "the tides",
    "how public-key encryption works", "why we dream", "how an airplane wing produces lift",
    "the Doppler effect", "how a search engine ranks pages", "what causes earthquakes",
    "how a compiler turns code into a program", "opportunity cost", "how muscles grow after exercise",
    "what a blockchain is", "why ice floats on water", "how a microwave oven heats food",
]
EXPLAIN_FORMS = [
    "Explain {} in simple terms.",
    "Can you explain {} to a 12-year-old?",
    "What is the basic idea behind {}? Keep it short.",
    "I never understood {}. Could you walk me through it?",
    "Give me a clear, two-paragraph explanation of {}.",
    "Explain {} using an everyday analogy.",
]

HOWTO_TASKS = [
    "make a simple tomato pasta sauce", "change a flat bicycle tyre", "start a vegetable garden on a balcony",
    "write a good cover letter", "set up a monthly budget", "brew pour-over coffee", "clean a cast-iron pan",
    "prepare for a job interview", "back up the photos on my phone", "learn to touch type",
    "hang a picture frame straight", "make friends in a new city", "train a puppy to sit",
    "fall asleep faster", "write a clear email to my manager asking for a day off",
    "get started with running if I have never exercised", "bake a loaf of bread without a bread machine",
    "remove a coffee stain from a shirt", "create a strong password I can remember", "meditate for five minutes",
    "plan a weekend camping trip", "give a short toast at a wedding", "organise a small closet",
    "take better photos with a phone", "repot a houseplant", "make a paper airplane that flies far",
    "study for an exam in one week", "negotiate a lower price at a market", "boil an egg so the yolk is soft",
    "keep a reading habit going", "set up a new Git repository", "make a cup of proper masala chai",
    "tie a bowline knot", "unclog a bathroom sink without chemicals", "prepare a simple stir-fry",
    "write a to-do list that I will actually follow",
]
HOWTO_FORMS = [
    "How do I {}?",
    "Give me step-by-step instructions to {}.",
    "What's the easiest way to {}?",
    "I'm a beginner. How should I {}?",
    "Walk me through how to {}, in numbered steps.",
    "Can you tell me how to {}?",
]

LIST_ITEMS = [
    "healthy breakfast ideas", "books for someone who loved The Hobbit", "ways to save money on groceries",
    "indoor activities for a rainy day with kids", "tips for writing clean Python code",
    "interesting facts about octopuses", "questions to ask at the end of a job interview",
    "names for a small bakery", "things to pack for a beach holiday", "hobbies that cost almost nothing",
    "common mistakes new programmers make", "ways to reduce plastic use at home", "classic films everyone should see",
    "icebreaker questions for a team meeting", "vegetables that grow well in pots",
    "ways to stay focused while working from home", "birthday gift ideas for a grandmother",
    "board games for two players", "signs that a website might be a scam", "easy recipes using eggs",
    "words that sound like what they mean", "reasons to learn a second language", "cheap date ideas",
    "famous inventions from the 19th century", "things to do in a city on a layover of six hours",
    "podcast topic ideas for a beginner", "stretches for people who sit all day", "uses for baking soda",
    "habits of good listeners", "snacks to bring on a long hike", "ways to make a small room feel bigger",
    "animals that live in the desert", "questions to get to know someone better", "tips for a first marathon",
    "fun science experiments to do at home", "ways to thank a teacher",
]
LIST_FORMS = [
    "List ten {}.",
    "Give me five {}.",
    "What are some {}? A short bullet list is fine.",
    "Make a list of seven {}, with one sentence on each.",
    "Brainstorm {} for me.",
    "Suggest eight {}.",
]

STORY_IDEAS = [
    "a lighthouse keeper who finds a message in a bottle", "a robot learning to bake bread",
    "a cat who thinks it runs the household", "two strangers stuck in a lift during a power cut",
    "a child who discovers a door in the back of a wardrobe that leads to the sea",
    "the last bookshop in a city", "a dragon who is afraid of fire", "a time traveller who forgets why they came",
    "a village where it never stops snowing", "an old man and the crow that visits him every morning",
    "a detective who solves crimes using only smells", "a spaceship crew that finds a garden on Mars",
    "a girl who can talk to trees", "a lost umbrella trying to find its owner", "a chef competing against a machine",
    "a postman delivering letters to the moon", "a shy ghost haunting a busy café",
    "a fisherman who catches a star", "twins who swap places for a day", "a clockmaker whose clocks run backwards",
    "a librarian who guards a book that writes itself", "a mouse that wants to fly",
    "a city where everyone whispers", "a musician who can only play one note",
    "an astronaut's first day back on Earth", "a tortoise entering a talent show",
    "a kite that escapes into the sky", "a grandmother's secret recipe", "a map that changes every night",
    "a snowman who wants to see summer", "a boy who collects lost sounds", "a train that never stops",
    "a painter whose paintings come alive", "a squirrel planning the perfect heist",
]
STORY_FORMS = [
    "Write a short story about {}.",
    "Tell me a bedtime story about {}.",
    "Write a 200-word story about {}.",
    "Write a story with a happy ending about {}.",
    "Write a funny short story about {}.",
    "Write a very short story (under 150 words) about {}.",
]

POEM_SUBJECTS = [
    "the ocean at night", "a rainy Monday morning", "autumn leaves", "friendship", "the smell of coffee",
    "a city waking up", "the moon", "an old tree", "learning to ride a bike", "the first snow of winter",
    "a cat asleep in the sun", "missing home", "the stars over a desert", "a busy train station",
    "spring flowers", "a thunderstorm", "growing old", "a mountain lake", "the end of summer",
    "a lighthouse", "the sound of rain on a roof", "a candle", "a garden at dawn", "the wind",
    "a bowl of soup on a cold day", "a library", "hope", "a river", "fireflies", "a quiet Sunday",
    "bees", "the colour blue", "an empty playground", "a kite", "a long road trip",
]
POEM_FORMS = [
    "Write a short poem about {}.",
    "Write a haiku about {}.",
    "Write a four-line rhyming poem about {}.",
    "Write a limerick about {}.",
    "Write a free-verse poem about {}.",
    "Compose a gentle, calm poem about {}.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text file",
    "returns the n-th Fibonacci number", "removes duplicates from a list while keeping order",
    "checks if a string is a palindrome", "merges two sorted lists", "finds the largest number in a list",
    "converts Celsius to Fahrenheit", "computes the factorial of a number", "flattens a nested list",
    "counts how often each character appears in a string", "sorts a list of dictionaries by a key",
    "validates a simple email address", "reads a CSV file and prints the average of a column",
    "implements binary search", "checks if two strings are anagrams", "generates a random password",
    "finds the greatest common divisor of two numbers", "transposes a matrix", "implements FizzBuzz",
    "returns the second largest number in a list", "capitalises the first letter of every word",
    "computes the running sum of a list", "checks whether brackets in a string are balanced",
    "groups words by their first letter", "implements a simple stack class",
    "converts a Roman numeral to an integer", "finds all pairs in a list that sum to a target",
    "rotates a list by k positions", "counts vowels in a sentence", "implements bubble sort",
    "returns the intersection of two lists", "chunks a list into pieces of size n",
    "finds the longest word in a sentence", "converts a number to binary without built-ins",
]
CODE_LANGS = ["Python", "JavaScript", "Python", "C", "Python", "Go", "Python", "Rust", "Python", "Java"]
CODE_FORMS = [
    "Write a {lang} function that {task}.",
    "Show me how to write a {lang} function that {task}, with a short explanation.",
    "In {lang}, write a function that {task}. Add a couple of test cases.",
    "Can you write {lang} code that {task}?",
    "I need a {lang} function that {task}. Keep it simple and readable.",
]

MATH_PROBLEMS = [
    "A shop sells pencils at 3 for $1. How much do 27 pencils cost?",
    "Tom has 48 marbles. He gives a quarter to his sister and 5 to a friend. How many does he have left?",
    "A train travels 180 km in 2.5 hours. What is its average speed?",
    "A recipe needs 250 g of flour for 10 cookies. How much flour is needed for 36 cookies?",
    "If a shirt costs $40 and is on sale for 25% off, what is the sale price?",
    "Sara reads 15 pages a day. How many days will it take her to read a 320-page book?",
    "A rectangle has a perimeter of 36 cm and a length of 11 cm. What is its area?",
    "Three friends split a $57 bill equally and add a 10% tip on the whole bill. How much does each pay?",
    "A tank holds 600 litres and fills at 25 litres per minute. How long until it is full if it starts at 150 litres?",
    "A car uses 6 litres of fuel per 100 km. How much fuel does it need for a 350 km trip?",
    "The sum of two numbers is 50 and their difference is 14. What are the numbers?",
    "A baker makes 144 rolls and packs them in bags of 8. How many bags does she fill?",
    "A phone plan costs $15 a month plus $0.10 per text. What is the bill for 230 texts?",
    "Anna is three times as old as her son. In 12 years she will be twice as old. How old is she now?",
    "A garden is 8 m by 5 m. A path 1 m wide runs around the outside. What is the area of the path?",
    "Two trains leave stations 300 km apart, heading towards each other at 70 km/h and 80 km/h. When do they meet?",
    "If 5 workers build a wall in 12 days, how long would 8 workers take at the same rate?",
    "A class has 28 students and the ratio of boys to girls is 3:4. How many girls are there?",
    "A bike costs $240 after a 20% discount. What was the original price?",
    "What is the average of 12, 15, 21, 8 and 19?",
    "A cinema sells adult tickets for $12 and child tickets for $7. A family pays $50 for 5 tickets. How many adults?",
    "A savings account pays 4% simple interest per year. How much interest does $2,500 earn in 3 years?",
    "A clock shows 3:15. What is the angle between the hour and minute hands?",
    "A box of 12 eggs costs $3.60. What is the price of 30 eggs?",
    "Jake runs 5 km in 28 minutes. At the same pace, how long would 12 km take?",
    "A pizza is cut into 8 slices. Maya eats 3 and Leo eats 2. What fraction is left?",
    "A farmer has chickens and cows, 30 heads and 84 legs in total. How many cows are there?",
    "A map scale is 1:50,000. Two towns are 7 cm apart on the map. How far apart are they in km?",
    "The price of a laptop rose from $800 to $920. What was the percentage increase?",
    "A swimming pool is 25 m long. How many lengths does Priya swim in a 1.5 km session?",
    "A bag has 4 red, 6 blue and 10 green marbles. What is the probability of drawing a blue one?",
    "A water bottle holds 750 ml. How many bottles fill a 6-litre jug?",
    "Ben saves $35 a week. How many weeks until he can buy a $420 bike?",
    "The angles of a triangle are in the ratio 2:3:4. What are the angles?",
    "A square has an area of 81 square metres. What is its perimeter?",
]
MATH_FORMS = [
    "{} Show your working.",
    "Solve this word problem step by step: {}",
    "{}",
    "Can you help me with this? {} Explain each step.",
    "Math question: {}",
]

REWRITE_TEXTS = [
    ("Rewrite this sentence to sound more formal:", "hey, can u send me the report by tmrw? thx"),
    ("Make this paragraph more concise:", "In my personal opinion, I think that it is very important and "
     "essential for all of us to make sure that we always remember to turn off the lights when we leave the room."),
    ("Rewrite this in plain English:", "The aforementioned party shall remit payment forthwith upon receipt of "
     "the invoice, notwithstanding any prior arrangements."),
    ("Fix the grammar in this sentence:", "Me and him goes to the store yesterday and buyed three apple."),
    ("Rewrite this product description to sound more exciting:", "This is a water bottle. It holds one litre. "
     "It is blue."),
    ("Turn this into a polite email:", "Your package is late again. Fix it."),
    ("Rewrite this sentence in the passive voice:", "The committee approved the new budget on Friday."),
    ("Make this text friendlier:", "Submit the form by Monday. Late forms will not be accepted."),
    ("Summarise this in one sentence:", "The city council met on Tuesday to discuss the new bike lanes. "
     "Residents were divided: some welcomed safer cycling, while shop owners worried about losing parking. "
     "The council agreed to a six-month trial on two streets."),
    ("Rewrite this for a ten-year-old:", "Photosynthesis is the process by which plants convert light energy "
     "into chemical energy stored in glucose."),
    ("Paraphrase this quote in your own words:", "The best time to plant a tree was twenty years ago. "
     "The second best time is now."),
    ("Rewrite this sentence so it is less repetitive:", "The meeting was a good meeting and everyone at the "
     "meeting agreed the meeting was useful."),
    ("Make this tweet sound more professional:", "omg our new app is finally out!!! go download it rn it's "
     "sooo good"),
    ("Rewrite this opening line to make it more gripping:", "It was a normal day and John went to work."),
    ("Rewrite this as a bulleted list:", "To get ready you should pack your bag, check the weather, charge your "
     "phone and leave the house by eight."),
    ("Rewrite this in the style of a pirate:", "Please remember to wash your hands before dinner."),
    ("Shorten this to under 20 words:", "We would like to take this opportunity to inform you that our office "
     "will be closed for the upcoming public holiday and will reopen on the following Tuesday."),
    ("Make this apology sound more sincere:", "Sorry if you were upset by what happened."),
    ("Rewrite this in the first person:", "She walked into the room, looked around, and sat by the window."),
    ("Translate this corporate jargon into simple words:", "We need to leverage our synergies to move the "
     "needle on key deliverables going forward."),
    ("Rewrite this sentence to be more positive:", "You failed to finish the project on time."),
    ("Turn these notes into a short paragraph:", "new café opened - Main St - good coffee - slow service - "
     "nice garden seating"),
    ("Rewrite this headline to be clearer:", "Local Man Bites Dog Owner Fine Debate Continues"),
    ("Make this instruction clearer:", "Put the thing in the other thing and then turn it until it does the click."),
    ("Rewrite this text message as a formal letter:", "can't make it to the meeting, sick, sorry"),
    ("Rewrite this sentence with stronger verbs:", "He went quickly down the street and got into the car."),
    ("Rewrite this paragraph in the past tense:", "I wake up early, make tea, and read the news before "
     "I walk to work."),
    ("Rewrite this to sound more confident:", "I think maybe I could possibly help with the project if "
     "that's okay."),
    ("Edit this for clarity:", "The reason why the results were bad is because of the fact that the data "
     "was not good."),
    ("Rewrite this review to be more balanced:", "This restaurant is the worst place ever, never go there."),
    ("Rewrite this sentence as a question:", "The museum opens at nine on weekdays."),
    ("Rewrite this as a short rhyming couplet:", "Remember to water the plants while I am away."),
    ("Simplify this sentence:", "Due to unforeseen circumstances beyond our control, the event has been "
     "postponed until a later date to be determined."),
    ("Rewrite this in a cheerful tone:", "The office will be closed on Friday."),
]

COMPARE_PAIRS = [
    ("cats", "dogs as pets"), ("Python", "JavaScript for a first programming language"),
    ("renting", "buying a home"), ("electric cars", "petrol cars"), ("tea", "coffee"),
    ("e-books", "paper books"), ("running", "swimming for fitness"), ("a laptop", "a desktop computer"),
    ("living in a city", "living in the countryside"), ("stocks", "bonds"), ("SQL", "NoSQL databases"),
    ("learning piano", "learning guitar"), ("a gap year", "going straight to university"),
    ("trains", "planes for a 500 km trip"), ("a Roth IRA", "a traditional IRA"), ("summer", "winter holidays"),
    ("public", "private schools"), ("Android", "iOS"), ("working from home", "working in an office"),
    ("crocodiles", "alligators"), ("viruses", "bacteria"), ("baking", "frying"),
    ("a debit card", "a credit card"), ("freelancing", "a full-time job"), ("lists", "tuples in Python"),
    ("weather", "climate"), ("yoga", "pilates"), ("solar", "wind power"), ("a hotel", "a holiday rental"),
    ("TCP", "UDP"), ("fiction", "non-fiction for relaxing reading"), ("butter", "olive oil for cooking"),
    ("hiking boots", "trail running shoes"), ("a mortgage with a fixed rate", "one with a variable rate"),
    ("Git merge", "Git rebase"),
]
COMPARE_FORMS = [
    "Compare {} and {}.",
    "What are the pros and cons of {} versus {}?",
    "{} or {}? Help me decide.",
    "What is the difference between {} and {}?",
    "Give me a short comparison table of {} and {}.",
    "Which is better, {} or {}, and why?",
]

ADVICE_SITUATIONS = [
    "I get nervous before speaking in public.", "My roommate never does the dishes.",
    "I keep procrastinating on my thesis.", "I want to switch careers into software engineering at 35.",
    "My friend forgot my birthday and I feel hurt.", "I can't seem to save any money.",
    "I'm starting a new job next week and feel anxious.", "My teenager spends all day on their phone.",
    "I have too many meetings and no time for real work.", "I want to get back into exercise after an injury.",
    "I disagree with my manager about a project decision.", "I feel lonely after moving abroad.",
    "I'm overwhelmed by a long to-do list.", "My neighbour plays loud music late at night.",
    "I want to ask for a raise.", "I can't decide which university offer to accept.",
    "I keep waking up tired even after eight hours of sleep.", "I want to read more but never find the time.",
    "A colleague keeps taking credit for my work.", "I'm planning my first trip abroad alone.",
    "I want to learn to cook but I'm scared of failing.", "My small business has few online customers.",
    "I said something hurtful to my sister.", "I'm nervous about my first marathon next month.",
    "I spend too much money on takeaway food.", "I get distracted by notifications all the time.",
    "I want to be a better listener.", "My dog barks whenever I leave the house.",
    "I have a job offer with higher pay but a longer commute.", "I want to start journaling.",
    "My group project partners aren't doing their share.", "I feel stuck in my career.",
    "I'm hosting my partner's parents for dinner for the first time.",
    "I want to cut down on sugar.", "I struggle to say no when people ask for favours.",
    "I've been asked to give feedback to a struggling teammate.",
]
ADVICE_FORMS = [
    "{} What should I do?",
    "{} Any advice?",
    "{} How can I handle this?",
    "Can you give me some practical tips? {}",
    "{} What would you suggest?",
    "I need some advice. {}",
]


def _fill(subjects, forms) -> list[str]:
    return [forms[i % len(forms)].format(s) for i, s in enumerate(subjects)]


def all_prompts() -> dict[str, list[str]]:
    """Every prompt, keyed by category, in a fixed order."""
    code = []
    for i, task in enumerate(CODE_TASKS):
        code.append(CODE_FORMS[i % len(CODE_FORMS)].format(lang=CODE_LANGS[i % len(CODE_LANGS)], task=task))
    prompts = {
        "explanation": _fill(EXPLAIN_TOPICS, EXPLAIN_FORMS),
        "howto": _fill(HOWTO_TASKS, HOWTO_FORMS),
        "list": _fill(LIST_ITEMS, LIST_FORMS),
        "story": _fill(STORY_IDEAS, STORY_FORMS),
        "poem": _fill(POEM_SUBJECTS, POEM_FORMS),
        "code": code,
        "math": _fill(MATH_PROBLEMS, MATH_FORMS),
        "rewrite": [f"{instr}\n\n{text}" for instr, text in REWRITE_TEXTS],
        "comparison": [COMPARE_FORMS[i % len(COMPARE_FORMS)].format(a, b) for i, (a, b) in enumerate(COMPARE_PAIRS)],
        "advice": _fill(ADVICE_SITUATIONS, ADVICE_FORMS),
    }
    return {cat: [p[0].upper() + p[1:] for p in ps] for cat, ps in prompts.items()}


def build() -> dict[str, list[dict]]:
    """The split: a seeded EVAL_FRACTION of each category goes to eval, the rest to train."""
    rng = random.Random(SEED)
    split = {"train": [], "eval": []}
    for category, prompts in all_prompts().items():
        items = [{"id": f"{category}-{i:03d}", "category": category, "prompt": p} for i, p in enumerate(prompts)]
        order = list(range(len(items)))
        rng.shuffle(order)
        n_eval = max(1, round(EVAL_FRACTION * len(items)))
        eval_idx = set(order[:n_eval])
        for i, item in enumerate(items):
            split["eval" if i in eval_idx else "train"].append(item)
    return split


if __name__ == "__main__":
    from minispec.data import PROMPTS_PATH as path

    data = build()
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path}: {len(data['train'])} train, {len(data['eval'])} eval")
