"""A seeded grammar that writes the training text of tpserve's default model.

Every document is produced by the code in this file from a ``random.Random``
seeded by the caller, so the corpus is the project's own work (Apache-2.0, like
the rest of tpserve) and is reproduced exactly by the same seed.

Document kinds (weights in ``_KINDS``):

* short children's stories with a hero, a friend, a family member, a place
  and an object, in several plots (a lost toy, sharing, a fear overcome,
  building something that falls down, helping an animal, shopping and
  counting, a trip to a place, a rainy day at home, a birthday);
* dialogues in quotes between two children;
* facts about numbers ("Seven is an odd number. Seven plus two is nine.");
* simple facts about animals, colours, days and seasons.

The sentences are regular on purpose: a model of about a million parameters
trained for a few minutes on two CPU cores should learn to write them fluently.

``python -m training.corpus --seed 1 -n 5`` prints examples.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

# Seeds of the two splits. The held-out split uses a different seed, so its
# documents are new draws from the same grammar.
TRAIN_SEED = 20240601
HELDOUT_SEED = 777

NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
]

GIRLS = ["Lily", "Mia", "Anna", "Sara", "Emma", "Zoe", "Lucy", "Ella", "Rosa", "Nina", "Amy", "Kate"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Omar", "Dan", "Luke"]
# (kind, name) pairs for animal heroes; the gender is drawn separately.
ANIMAL_HEROES = [
    ("cat", ["Tib", "Coco", "Mimi"]), ("dog", ["Spot", "Rex", "Buddy"]),
    ("rabbit", ["Pip", "Hop", "Daisy"]), ("bear", ["Bruno", "Honey"]),
    ("bird", ["Tweet", "Sky"]), ("mouse", ["Squeak", "Nibs"]), ("duck", ["Puddle", "Waddle"]),
    ("fox", ["Rusty", "Red"]),
]
HERO_ADJ = ["little", "kind", "happy", "curious", "brave", "shy", "clever", "small", "young", "funny"]
FAMILY = [("mom", "f"), ("dad", "m"), ("grandma", "f"), ("grandpa", "m"), ("big sister", "f"), ("big brother", "m")]
COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "brown", "black"]
SIZES = ["big", "small", "little", "new", "old", "shiny", "soft"]
# Objects: (noun, what a child does with it)
OBJECTS = [
    ("ball", "kick the ball"), ("kite", "fly the kite"), ("teddy bear", "hug the teddy bear"),
    ("book", "read the book"), ("hat", "wear the hat"), ("toy car", "race the toy car"),
    ("drum", "play the drum"), ("boat", "sail the boat"), ("doll", "dress the doll"),
    ("shell", "look at the shell"), ("box", "open the box"), ("blanket", "sit on the blanket"),
    ("bike", "ride the bike"), ("crayon", "draw with the crayon"), ("robot", "play with the robot"),
    ("puzzle", "finish the puzzle"),
]
# Places: (name with preposition, bare name, hiding spots, things to see)
PLACES = [
    ("in the park", "the park", ["under the slide", "behind a big tree", "near the swings", "in the tall grass"],
     ["a red swing", "a big slide", "a little pond", "many ducks"]),
    ("in the garden", "the garden", ["under a big leaf", "behind the flowers", "next to the fence", "in the flower pot"],
     ["pretty flowers", "a small bee", "a green frog", "red tomatoes"]),
    ("at the beach", "the beach", ["under the sand", "behind a rock", "near the water", "in a bucket"],
     ["big waves", "white shells", "a little crab", "a sand castle"]),
    ("in the forest", "the forest", ["under a log", "behind a bush", "near a tall tree", "in a pile of leaves"],
     ["tall trees", "a brown owl", "a quick squirrel", "a small stream"]),
    ("on the farm", "the farm", ["in the barn", "behind the hay", "near the pigs", "under the cart"],
     ["a big cow", "three pigs", "a white horse", "little chicks"]),
    ("at school", "school", ["under a desk", "behind the door", "in the toy box", "near the window"],
     ["a big map", "many books", "a fish tank", "colorful paints"]),
    ("in the kitchen", "the kitchen", ["under the table", "behind a chair", "in a cup", "next to the oven"],
     ["a warm oven", "a bowl of fruit", "a big pot", "fresh bread"]),
    ("by the river", "the river", ["under a bridge", "behind a stone", "near the boats", "in the reeds"],
     ["a little boat", "a green frog", "quick fish", "a wooden bridge"]),
    ("on the hill", "the hill", ["behind a rock", "under a bush", "near the top", "in the long grass"],
     ["the whole town", "white clouds", "a windmill", "many sheep"]),
    ("at the zoo", "the zoo", ["near the lions", "behind a bench", "under a tree", "by the gate"],
     ["a tall giraffe", "a big elephant", "funny monkeys", "a sleepy lion"]),
]
FOODS = ["apple", "cookie", "sandwich", "banana", "cake", "orange", "pear", "muffin", "carrot", "peach"]
FRUITS = ["apples", "bananas", "oranges", "pears", "peaches", "plums", "carrots", "eggs", "cookies", "muffins"]
OPENERS = [
    "Once upon a time,", "One day,", "One sunny morning,", "Long ago,", "On a warm summer day,",
    "One cold winter day,", "One bright morning,", "Last spring,", "One windy afternoon,",
]
FEAR = [
    ("the dark", "At night, the room was very dark.", "turned on a small light",
     "The dark is not so scary when you are brave."),
    ("the big dog next door", "The big dog next door barked very loudly.", "said hello to the dog",
     "The dog only wanted to play."),
    ("the loud thunder", "Outside, the thunder went boom.", "counted to ten with a calm voice",
     "Thunder is loud, but it cannot hurt you inside."),
    ("the deep water", "The water at the pool looked very deep.", "held on to the side and kicked",
     "Soon swimming was fun."),
    ("the tall slide", "The slide in the park was very tall.", "climbed up one step at a time",
     "Going down the slide was the best part of the day."),
    ("the first day of school", "The new school was big and full of children.", "said hello to a new friend",
     "School was not scary at all."),
]
BUILDS = [
    ("a tower of blocks", "the tower", "fell down with a crash", "put the big blocks at the bottom"),
    ("a sand castle", "the castle", "was washed away by a wave", "built it far from the water"),
    ("a snowman", "the snowman", "fell over in the wind", "made the bottom ball bigger"),
    ("a paper boat", "the boat", "got wet and sank", "folded it with thick paper"),
    ("a house of cards", "the house", "fell flat on the table", "built it very slowly"),
    ("a bird house", "the bird house", "broke into pieces", "used more nails and glue"),
]
ANIMALS_IN_NEED = [
    ("a little bird", "it had a hurt wing", "put it in a soft box and gave it water", "flew up into the sky"),
    ("a small kitten", "it was stuck in a tree", "got a ladder and helped it down", "purred and rubbed her legs"),
    ("a baby duck", "it could not find its mother", "walked with it to the pond", "swam to its mother"),
    ("a tiny turtle", "it was on its back", "turned it over gently", "walked slowly into the grass"),
    ("a lost puppy", "it was cold and hungry", "gave it some food and a blanket", "wagged its tail"),
    ("a little frog", "it was stuck in a jar", "opened the jar", "jumped back into the pond"),
]
FEELINGS_GOOD = ["happy", "glad", "excited", "proud"]
FEELINGS_BAD = ["sad", "upset", "worried", "lonely"]
MORALS_SHARE = [
    "Sharing makes everyone happy.", "It is more fun to play together.",
    "A good friend shares.", "From that day on, they always shared.",
]
MORALS_TRY = [
    "If at first you do not succeed, try again.", "Never give up.",
    "Trying again is how we learn.", "Working together makes things better.",
]
ENDINGS = [
    "It was a very good day.", "They were best friends forever.", "Then it was time to go home.",
    "That night, {h} slept with a big smile.", "{H} would never forget that day.",
    "And they all lived happily ever after.", "The end.",
]
ANIMAL_SOUNDS = [
    ("cow", "cows", "moo", "on the farm", "eat grass"), ("cat", "cats", "meow", "in the house", "drink milk"),
    ("dog", "dogs", "woof", "in the house", "chew bones"), ("duck", "ducks", "quack", "on the pond", "eat bread"),
    ("sheep", "sheep", "baa", "on the farm", "eat grass"), ("pig", "pigs", "oink", "on the farm", "roll in the mud"),
    ("horse", "horses", "neigh", "in the barn", "eat hay"), ("owl", "owls", "hoot", "in the trees", "eat mice"),
    ("lion", "lions", "roar", "in the grass", "eat meat"), ("frog", "frogs", "ribbit", "in the pond", "eat flies"),
    ("bee", "bees", "buzz", "in the hive", "make honey"), ("hen", "hens", "cluck", "on the farm", "lay eggs"),
]
CAN = [
    ("Birds", "fly"), ("Fish", "swim"), ("Frogs", "jump"), ("Rabbits", "hop"), ("Horses", "run fast"),
    ("Monkeys", "climb trees"), ("Ducks", "swim and fly"), ("Snakes", "slide on the ground"),
]
COLOR_FACTS = [
    "The sky is blue.", "Grass is green.", "Bananas are yellow.", "Snow is white.", "Apples can be red or green.",
    "The sun is yellow.", "Carrots are orange.", "Strawberries are red.", "Clouds are white or gray.",
    "Chocolate is brown.", "Leaves turn red and yellow in the fall.", "The night sky is dark.",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SEASONS = [
    ("spring", "flowers grow and birds sing"), ("summer", "the days are long and hot"),
    ("fall", "the leaves fall from the trees"), ("winter", "it is cold and sometimes it snows"),
]


@dataclass
class Person:
    name: str
    male: bool
    desc: str  # "a little girl named Lily"

    @property
    def he(self) -> str:
        return "he" if self.male else "she"

    @property
    def He(self) -> str:
        return "He" if self.male else "She"

    @property
    def his(self) -> str:
        return "his" if self.male else "her"

    @property
    def His(self) -> str:
        return "His" if self.male else "Her"

    @property
    def him(self) -> str:
        return "him" if self.male else "her"


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def art(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def the(phrase: str) -> str:
    """'a green frog' -> 'the green frog', 'many ducks' -> 'the ducks'."""
    first, _, rest = phrase.partition(" ")
    if first == "the":
        return phrase
    if first in ("a", "an", "many", "three"):
        return "the " + rest
    return "the " + phrase


def num(n: int) -> str:
    return NUMBERS[n]


class Grammar:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self._opener = ""
        # a hero asked for by a chat request (``chat``): the next person() that may be it returns it
        self._hero: Person | None = None

    # -- helpers --------------------------------------------------------
    def pick(self, xs):
        return self.r.choice(xs)

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def person(self, exclude=(), allow_animal: bool = True) -> Person:
        hero, self._hero = self._hero, None
        if hero is not None:
            return hero
        r = self.r
        while True:
            if allow_animal and r.random() < 0.25:
                kind, names = r.choice(ANIMAL_HEROES)
                name = r.choice(names)
                male = r.random() < 0.5
                desc = f"{art(r.choice(HERO_ADJ))} {kind} named {name}"
            else:
                male = r.random() < 0.5
                name = r.choice(BOYS if male else GIRLS)
                desc = f"{art(r.choice(HERO_ADJ))} {'boy' if male else 'girl'} named {name}"
            if name not in exclude:
                return Person(name, male, desc)

    def friend(self, hero: Person) -> Person:
        # friends are children, so that a name never names two beings
        return self.person(exclude=(hero.name,), allow_animal=False)

    def obj(self):
        noun, play = self.pick(OBJECTS)
        adj = self.pick(COLORS) if self.chance(0.6) else self.pick(SIZES)
        return noun, adj, play

    def said(self, who: str, words: str, verb: str = "said") -> str:
        """A quoted line, in one of three orders."""
        q = words if words[-1] in "?!" else words[:-1] + ","
        # "Her mom" opens a sentence; after the quote it is "her mom"
        mid = who[0].lower() + who[1:] if who.split()[0] in ("His", "Her") else who
        k = self.r.random()
        if verb == "asked" or words[-1] == "?":
            verb = "asked"
        if k < 0.4:
            return f'"{q}" {verb} {mid}.'
        if k < 0.7:
            return f'{who} {verb}, "{words}"'
        return f'"{q}" {mid} {verb}.'

    def ending(self, hero: Person) -> str:
        return self.pick(ENDINGS).format(h=hero.he, H=hero.He)

    def one_day(self) -> str:
        """'One day,' unless the story already opened with it."""
        return "That day," if self._opener == "One day," else "One day,"

    def opener(self, hero: Person) -> str:
        o = self._opener = self.pick(OPENERS)
        k = self.r.random()
        if k < 0.5:
            return f"{o} there was {hero.desc}."
        if k < 0.8:
            return f"{o} {hero.desc} lived in a small house near {self.pick(PLACES)[1]}."
        return f"{hero.name} was {hero.desc.split(' named ')[0]}."

    # -- story plots ----------------------------------------------------
    def story_lost(self) -> str:
        h = self.person()
        f = self.friend(h)
        noun, adj, play = self.obj()
        place, _, spots, _ = self.pick(PLACES)
        s1, s2, s3 = self.r.sample(spots, 3)
        bad = self.pick(["sad", "upset", "worried"])
        out = [self.opener(h)]
        out.append(f"{h.He} had {art(adj)} {noun}.")
        out.append(f"{h.He} loved to {play} {place} every day.")
        out.append(f"{self.one_day()} {h.name} could not find {h.his} {noun}.")
        out.append(f"{h.He} was very {bad}.")
        out.append(self.said(h.name, f"Where is my {noun}?"))
        out.append(f"{h.He} looked {s1}, but it was not there.")
        if self.chance(0.5):
            out.append(f"{h.He} looked {s2}, but it was not there either.")
        out.append(f"Then {h.his} friend {f.name} came to help.")
        out.append(self.said(f.name, self.pick([
            "Do not worry, I will help you.", "Let us look together.", "I can help you find it!"])))
        out.append(f"They looked {s3}, and there it was!")
        out.append(f"{h.name} was so {self.pick(['happy', 'glad'])}.")
        out.append(self.said(h.name, f"Thank you, {f.name}!"))
        if self.chance(0.6):
            out.append(f"Then {h.name} and {f.name} played with the {noun} together.")
        out.append(self.ending(h))
        return " ".join(out)

    def story_share(self) -> str:
        h = self.person()
        f = self.friend(h)
        if self.chance(0.5):
            food = self.pick(FOODS)
            thing, have = food, f"{art(food)} for lunch"
            use = f"eat the {food}"
        else:
            noun, adj, play = self.obj()
            thing, have = noun, f"{art(adj)} {noun}"
            use = play
        place = self.pick(PLACES)[0]
        out = [self.opener(h)]
        out.append(f"{self.one_day()} {h.name} was {place} with {h.his} friend {f.name}.")
        out.append(f"{h.name} had {have}.")
        out.append(f"{f.name} did not have one.")
        out.append(self.said(f.name, f"Can I {use} too?"))
        out.append(self.said(h.name, f"No, it is my {thing}!"))
        out.append(f"{f.name} felt {self.pick(FEELINGS_BAD)} and looked down.")
        out.append(f"{h.name} saw that {f.name} was sad.")
        out.append(f"{h.He} thought about it for a moment.")
        if thing in FOODS:
            out.append(f"Then {h.he} broke the {thing} in two and gave half to {f.name}.")
        else:
            out.append(f"Then {h.he} gave the {thing} to {f.name}.")
        out.append(self.said(h.name, "Here, we can share."))
        out.append(self.said(f.name, "Thank you! You are a good friend."))
        out.append(f"They were both {self.pick(FEELINGS_GOOD)}.")
        out.append(self.pick(MORALS_SHARE))
        return " ".join(out)

    def story_fear(self) -> str:
        h = self.person()
        fam, _ = self.pick(FAMILY)
        thing, scene, act, lesson = self.pick(FEAR)
        out = [self.opener(h)]
        out.append(f"{h.name} was afraid of {thing}.")
        out.append(scene)
        out.append(f"{h.name} felt scared and ran to {h.his} {fam}.")
        out.append(self.said(h.name, f"I am scared of {thing}!"))
        out.append(f"{h.His} {fam} gave {h.him} a big hug.")
        out.append(self.said(f"{h.His} {fam}", self.pick([
            "Do not be afraid. I am here with you.", "You are braver than you think.",
            "Take a deep breath. You can do it."])))
        out.append(f"{h.name} took a deep breath.")
        out.append(f"Then {h.he} {act}.")
        out.append(f"{lesson}")
        out.append(f"{h.name} felt {self.pick(['proud', 'brave', 'happy', 'strong'])}.")
        out.append(self.said(h.name, f"Look, {fam}! I am not scared anymore!"))
        out.append(f"{h.His} {fam} smiled.")
        out.append(self.pick(["It was a very good day.", f"That night, {h.he} slept with a big smile.",
                              f"{h.He} would never forget that day.", "The end."]))
        return " ".join(out)

    def story_build(self) -> str:
        h = self.person()
        f = self.friend(h)
        what, it, fail, fix = self.pick(BUILDS)
        out = [self.opener(h)]
        out.append(f"{h.name} and {f.name} wanted to build {what}.")
        out.append("They worked very hard all morning.")
        out.append(f"At last, {it} was ready.")
        out.append(self.said(f.name, self.pick(["It is so big!", "It looks great!", "We did it!"])))
        out.append(f"But then {it} {fail}.")
        out.append(f"{h.name} was {self.pick(FEELINGS_BAD)}.")
        out.append(self.said(h.name, self.pick(["Oh no! Now we have nothing.", "Oh no! All our work is gone.",
                                                "Oh no! What can we do?"])))
        out.append(self.said(f.name, "Let us try again. We can do it better this time."))
        out.append(f"So they tried again, and this time they {fix}.")
        out.append(f"{cap(it)} was even better than before.")
        out.append(f"{h.name} and {f.name} were very {self.pick(FEELINGS_GOOD)}.")
        out.append(self.pick(MORALS_TRY))
        return " ".join(out)

    def story_help(self) -> str:
        h = self.person(allow_animal=False)
        animal, problem, help_, after = self.pick(ANIMALS_IN_NEED)
        place = self.pick(PLACES)[0]
        fam, _ = self.pick(FAMILY)
        out = [self.opener(h)]
        out.append(f"{self.one_day()} {h.name} was walking {place}.")
        out.append(f"{h.He} saw {animal}.")
        out.append(f"The poor animal was sad because {problem}.")
        out.append(self.said(h.name, self.pick(["Do not worry, little one. I will help you.",
                                                "Oh no! I must help it.", "Poor thing! I will help."])))
        if self.chance(0.5):
            out.append(f"{h.He} asked {h.his} {fam} for help.")
            out.append(f"Together they {help_}.")
        else:
            out.append(f"{h.He} {help_}.")
        out.append(f"Soon the animal felt better, and it {after}.")
        out.append(f"{h.name} felt warm inside.")
        out.append(self.said(h.name, "I am glad I could help."))
        out.append(self.pick(["Helping others is a good thing to do.", "Being kind is the best.",
                              "Every day after that, " + h.he + " looked out for animals in need."]))
        return " ".join(out)

    def story_shop(self) -> str:
        h = self.person(allow_animal=False)
        fam, _ = self.pick(FAMILY)
        a, b = self.r.sample(FRUITS, 2)
        n = self.r.randint(1, 9)
        m = self.r.randint(1, 9)
        out = [self.opener(h)]
        out.append(f"{h.name} went to the shop with {h.his} {fam}.")
        out.append("They needed food for dinner.")
        out.append(f"{h.name} put {num(n)} {a if n > 1 else a[:-1] if not a.endswith('ches') else a[:-2]} in the basket.")
        out.append(f"Then {h.he} put {num(m)} {b if m > 1 else b[:-1] if not b.endswith('ches') else b[:-2]} in the basket.")
        out.append(self.said(f"{h.His} {fam}", "How many things are in the basket now?"))
        out.append(f"{h.name} counted them one by one.")
        out.append(self.said(h.name, f"{cap(num(n))} plus {num(m)} is {num(n + m)}!"))
        out.append(self.said(f"{h.His} {fam}", self.pick(["That is right! You are so clever.",
                                                            "Very good! You can count well.",
                                                            "Yes! Well done."])))
        out.append(f"{h.name} felt {self.pick(FEELINGS_GOOD)}.")
        out.append("At home, they made a nice dinner together.")
        return " ".join(out)

    def story_trip(self) -> str:
        h = self.person()
        fam, _ = self.pick(FAMILY)
        place, name, _, sights = self.pick(PLACES)
        x, y, z = self.r.sample(sights, 3)
        out = [self.opener(h)]
        out.append(f"{h.name} and {h.his} {fam} went to {name}.")
        out.append(f"{h.name} was very excited.")
        out.append(f"{cap(place)}, {h.he} saw {x} and {y}.")
        out.append(f"{h.He} also saw {z}.")
        out.append(self.said(h.name, self.pick([f"Look, {fam}! This is so much fun!",
                                                "I love this place!", "Can we stay a little longer?"])))
        out.append(f"{h.His} {fam} smiled and said yes.")
        out.append("When the sun went down, they went home.")
        out.append(f"{h.name} was tired but {self.pick(FEELINGS_GOOD)}.")
        out.append(f"That night, {h.he} told {h.his} teddy bear about {the(x)}.")
        return " ".join(out)

    def story_rain(self) -> str:
        h = self.person()
        f = self.friend(h)
        game = self.pick(["hide and seek", "a board game", "with blocks", "pretend to be pirates",
                          "with paper and paints", "a card game"])
        out = ["It was a rainy day.", f"{h.name} wanted to play outside, but the rain did not stop."]
        out.append(f"{h.He} sat by the window and felt {self.pick(FEELINGS_BAD)}.")
        out.append("Then there was a knock at the door.")
        out.append(f"It was {h.his} friend {f.name}!")
        out.append(self.said(f.name, "Let us play inside today."))
        out.append(f"So they played {game} all afternoon.")
        out.append("They laughed and laughed.")
        out.append("When the rain stopped, they saw a big rainbow in the sky.")
        out.append(self.said(h.name, "This was the best rainy day ever!"))
        return " ".join(out)

    def story_birthday(self) -> str:
        h = self.person()
        f = self.friend(h)
        age = self.r.randint(3, 10)
        noun, adj, play = self.obj()
        out = [self.opener(h)]
        out.append(f"Today was {h.name}'s birthday.")
        out.append(f"{h.He} was {num(age)} years old.")
        out.append(f"There was a big cake with {num(age)} candles.")
        out.append(f"{h.name} made a wish and blew out all the candles.")
        out.append(f"{h.His} friend {f.name} gave {h.him} a present.")
        out.append(f"It was {art(adj)} {noun}!")
        out.append(self.said(h.name, f"Thank you, {f.name}! I love it!"))
        out.append(f"After the party, they went outside to {play}.")
        out.append(f"Next year {h.name} will be {num(age + 1)}.")
        out.append(self.ending(h))
        return " ".join(out)

    # -- other kinds ----------------------------------------------------
    def dialogue(self) -> str:
        a = self.person(allow_animal=False)
        b = self.friend(a)
        place = self.pick(PLACES)[0]
        out = [f"{a.name} and {b.name} met {place}."]
        out.append(self.said(a.name, self.pick([f"Hello, {b.name}! How are you today?", f"Hi, {b.name}! How are you?"])))
        if self.chance(0.5):
            feel = self.pick(FEELINGS_GOOD)
            noun, adj, _ = self.obj()
            reason = self.pick([f"I got {art(adj)} {noun}", "my grandma is coming to visit",
                                "we are going to the beach tomorrow", "I learned to ride my bike"])
            out.append(self.said(b.name, f"I am {feel}!"))
            out.append(self.said(a.name, f"Why are you {feel}?"))
            out.append(self.said(b.name, f"Because {reason}."))
            out.append(self.said(a.name, self.pick(["That is great!", "How nice!", "Wow, I am happy for you!"])))
        else:
            feel = self.pick(FEELINGS_BAD)
            noun, adj, _ = self.obj()
            reason, help_ = self.pick([
                (f"I lost my {noun}", f"I will help you look for your {noun}."),
                ("my best friend moved away", "I can be your friend too."),
                ("nobody wants to play with me", "I will play with you!"),
                ("it is raining and I cannot go out", "We can play inside together."),
            ])
            out.append(self.said(b.name, f"I am {feel}."))
            out.append(self.said(a.name, f"Why are you {feel}?"))
            out.append(self.said(b.name, f"Because {reason}."))
            out.append(self.said(a.name, f"Do not be sad. {help_}"))
            out.append(self.said(b.name, f"Thank you, {a.name}. You are very kind."))
        out.append(self.pick(["Then they played together until dinner.", "They walked home together.",
                              f"{a.name} and {b.name} smiled."]))
        return " ".join(out)

    def numbers(self) -> str:
        out = []
        for _ in range(self.r.randint(2, 4)):
            n = self.r.randint(0, 20)
            N = cap(num(n))
            k = self.r.random()
            if k < 0.2:
                out.append(f"{N} is {'an even' if n % 2 == 0 else 'an odd'} number.")
            elif k < 0.4:
                m = self.r.randint(0, 20 - n)
                out.append(f"{N} plus {num(m)} is {num(n + m)}.")
            elif k < 0.55:
                m = self.r.randint(0, n)
                out.append(f"{N} minus {num(m)} is {num(n - m)}.")
            elif k < 0.7 and 0 < n < 20:
                out.append(f"{N} comes after {num(n - 1)} and before {num(n + 1)}.")
            elif k < 0.85:
                m = self.r.randint(0, 20)
                if m == n:
                    out.append(f"{N} is equal to {num(m)}.")
                else:
                    out.append(f"{N} is {'bigger' if n > m else 'smaller'} than {num(m)}.")
            else:
                start = self.r.randint(0, 14)
                step = self.r.choice([1, 1, 2])
                seq = [num(i) for i in range(start, min(20, start + 5 * step) + 1, step)][:6]
                out.append(f"Let us count: {', '.join(seq)}.")
        if self.chance(0.3):
            noun = self.pick(FRUITS)
            n, m = self.r.randint(2, 9), self.r.randint(1, 9)
            who = self.person(allow_animal=False)
            out.append(f"{who.name} has {num(n)} {noun}. {who.He} gets {num(m)} more. "
                       f"Now {who.he} has {num(n + m)} {noun}.")
        return " ".join(out)

    def facts(self) -> str:
        out = []
        for _ in range(self.r.randint(3, 5)):
            k = self.r.random()
            if k < 0.3:
                one, many, sound, home, eat = self.pick(ANIMAL_SOUNDS)
                out.append(self.pick([f"A {one} says {sound}.", f"{cap(many)} live {home}.",
                                      f"{cap(many)} like to {eat}.", f"The {one} says {sound}, {sound}!"]))
            elif k < 0.5:
                who, what = self.pick(CAN)
                out.append(f"{who} can {what}.")
            elif k < 0.7:
                out.append(self.pick(COLOR_FACTS))
            elif k < 0.85:
                i = self.r.randrange(7)
                out.append(self.pick([f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}.",
                                      "There are seven days in a week.",
                                      f"{DAYS[i]} is a day of the week."]))
            else:
                s, what = self.pick(SEASONS)
                out.append(f"In {s}, {what}.")
        return " ".join(out)

    _KINDS = [
        ("story_lost", 12), ("story_share", 10), ("story_fear", 9), ("story_build", 9),
        ("story_help", 9), ("story_shop", 7), ("story_trip", 8), ("story_rain", 6),
        ("story_birthday", 7), ("dialogue", 11), ("numbers", 7), ("facts", 5),
    ]

    def document(self) -> str:
        names = [k for k, _ in self._KINDS]
        weights = [w for _, w in self._KINDS]
        kind = self.r.choices(names, weights)[0]
        return getattr(self, kind)()


    # -- chat ------------------------------------------------------------
    _STORY_ASKS = ["Tell me a story about {x}.", "Tell me a story about {x}", "Can you tell me a story about {x}?",
                   "Please tell me a story about {x}.", "Write a story about {x}.", "I want a story about {x}.",
                   "tell me a story about {x}"]
    _ANY_STORY_ASKS = ["Tell me a story.", "Tell me a story", "Can you tell me a story?", "Please tell me a story.",
                       "Tell me a bedtime story.", "I want a story!", "Write a story."]
    # plots whose hero may be an animal (story_help and story_shop need a child)
    _ANIMAL_PLOTS = ["story_lost", "story_share", "story_fear", "story_build", "story_trip", "story_rain",
                     "story_birthday"]

    def _story_answer(self) -> tuple[str, str]:
        """A request for a story (about an animal, a named child, a girl or boy, or anything) and the story."""
        r = self.r
        k = r.random()
        plots = [name for name, _ in self._KINDS if name.startswith("story_")]
        if k < 0.45:
            kind, names = r.choice(ANIMAL_HEROES)
            male = r.random() < 0.5
            name = r.choice(names)
            adj = r.choice(HERO_ADJ)
            about = r.choice([f"a {kind}", f"a {kind}", f"{art(adj)} {kind}", f"a {kind} named {name}"])
            self._hero = Person(name, male, f"{art(adj)} {kind} named {name}")
            plots = self._ANIMAL_PLOTS
        elif k < 0.8:
            male = r.random() < 0.5
            name = r.choice(BOYS if male else GIRLS)
            adj = r.choice(HERO_ADJ)
            child = "boy" if male else "girl"
            about = r.choice([name, f"a {child}", f"a {child} named {name}", f"{art(adj)} {child}"])
            self._hero = Person(name, male, f"{art(adj)} {child} named {name}")
        else:
            about = None
        ask = r.choice(self._ANY_STORY_ASKS) if about is None else r.choice(self._STORY_ASKS).format(x=about)
        return ask, getattr(self, r.choice(plots))()

    def _fact_answer(self) -> tuple[str, str]:
        """A question about numbers, animals or days, and its answer in the grammar's words."""
        r = self.r
        k = r.random()
        if k < 0.3:
            n, m = r.randint(0, 10), r.randint(0, 10)
            return (r.choice([f"What is {num(n)} plus {num(m)}?", f"What is {n} plus {m}?"]),
                    f"{cap(num(n))} plus {num(m)} is {num(n + m)}.")
        if k < 0.45:
            n = r.randint(0, 20)
            return (f"Is {num(n)} odd or even?", f"{cap(num(n))} is {'an even' if n % 2 == 0 else 'an odd'} number.")
        if k < 0.75:
            one, many, sound, home, eat = self.pick(ANIMAL_SOUNDS)
            return self.pick([(f"What does a {one} say?", f"A {one} says {sound}."),
                              (f"Where do {many} live?", f"{cap(many)} live {home}."),
                              (f"What do {many} like to do?", f"{cap(many)} like to {eat}.")])
        if k < 0.9:
            i = r.randrange(7)
            return f"What comes after {DAYS[i]}?", f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
        return r.choice(["Hi!", "Hello!", "Hello, how are you?", "Hi, who are you?"]), r.choice([
            "Hello! I am a little story model. I can tell you a story about a cat, a dog or a girl named Lily.",
            "Hi! I am happy today. Do you want a story?", "Hello! I know many stories. Ask me for one!"])

    def chat(self) -> str:
        """One exchange in the chat format of the model's template (``CHAT_TEMPLATE``): a user
        line and the assistant's answer; three in four ask for a story."""
        ask, answer = self._story_answer() if self.chance(0.75) else self._fact_answer()
        return f"{USER}{ask}\n{ASSISTANT}{answer}"


# The chat format: what CHAT_TEMPLATE renders for a user message and the generation prompt
# (plain-text role markers: the tokenizer keeps only <s>, </s> and <unk> as special tokens).
USER = "User: "
ASSISTANT = "Assistant: "
# The model's chat template (tokenizer_config.json's ``chat_template``, Jinja as transformers renders
# it): a system message is a line of its own, each turn is ``User: ...`` / ``Assistant: ...`` on a
# line, and the generation prompt is ``Assistant:`` (the answer's first token brings its space).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}\n"
    "{% else %}{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
# Seeds of the chat exchanges mixed into the training text, and of their held-out set.
CHAT_TRAIN_SEED = 20261201
CHAT_HELDOUT_SEED = 778


def generate_chats(seed: int, n: int) -> list[str]:
    """``n`` chat exchanges (``Grammar.chat``) from the grammar seeded with ``seed``."""
    g = Grammar(seed)
    return [g.chat() for _ in range(n)]


def generate(seed: int, n: int) -> list[str]:
    """``n`` documents from the grammar seeded with ``seed`` (deterministic)."""
    g = Grammar(seed)
    return [g.document() for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=TRAIN_SEED)
    p.add_argument("-n", type=int, default=5)
    p.add_argument("--chat", action="store_true", help="chat exchanges (seed CHAT_TRAIN_SEED unless --seed)")
    a = p.parse_args()
    docs = generate_chats(CHAT_TRAIN_SEED if a.seed == TRAIN_SEED else a.seed, a.n) if a.chat else generate(a.seed, a.n)
    for d in docs:
        print(d, end="\n\n")


if __name__ == "__main__":
    main()
