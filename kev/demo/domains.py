"""The content of the demo task family: three document kinds in the System One shape.

Each `Domain` is one document kind with
- a `Category` (the `choice` question): which option the content decides, by sentences only
  that option's documents contain;
- a `Scale` (the `score` question): an intensity carried by sentences of one fine level, asked
  with one of several level sets (a 3-level set groups the 5 fine levels of a review);
- `Fact`s (the `noul` questions): a fact the text states (`yes` sentences), states the opposite
  of (`no` sentences, the near-miss distractors), or does not mention at all;
- fillers: sentences that bear on no question (the distractors every document is padded with).

Sentences are lower case and may hold slots `{n}` (a number), `{name}`, `{city}`, `{company}` and
`{thing}` (a word of the option that decides the category). In a sentence that answers a question,
`*word*` marks the words that decide the answer where only part of the sentence does; the marks are
stripped from the text and only steer the training signal (`kev.demo.tasks.Example.evidence`).
Every word used anywhere here is in the demo tokenizer's vocabulary (`kev.demo.tasks.vocabulary`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    key: str
    questions: tuple[str, ...]
    yes: tuple[str, ...]
    no: tuple[str, ...]
    true_description: str
    false_description: str


@dataclass(frozen=True)
class Option:
    name: str
    description: str
    sentences: tuple[str, ...]
    things: tuple[str, ...] = ()


@dataclass(frozen=True)
class Category:
    key: str
    questions: tuple[str, ...]
    options: tuple[Option, ...]


@dataclass(frozen=True)
class LevelSet:
    levels: tuple[str, ...]  # descriptions of the asked levels, 0-based
    of_fine: tuple[int, ...]  # asked level of each fine level


@dataclass(frozen=True)
class Scale:
    key: str
    questions: tuple[str, ...]
    sentences: tuple[tuple[str, ...], ...]  # per fine level
    level_sets: tuple[LevelSet, ...]


@dataclass(frozen=True)
class Domain:
    kind: str
    category: Category
    scale: Scale
    facts: tuple[Fact, ...]
    fillers: tuple[str, ...]
    openings: tuple[str, ...]
    closings: tuple[str, ...]


NAMES = ("anna", "ben", "carla", "david", "emma", "farid", "greta", "hugo", "ines", "jonas", "kim", "lena")
CITIES = ("berlin", "paris", "madrid", "vienna", "oslo", "lisbon", "prague", "dublin")
COMPANIES = ("acme", "globex", "initech", "umbrella", "northwind", "contoso")

_identity3 = (0, 1, 2)

TICKET = Domain(
    kind="ticket",
    category=Category(
        key="team",
        questions=(
            "which team should handle this ticket ?",
            "route this ticket to the right team .",
            "what is this support request about ?",
            "which department does this message belong to ?",
        ),
        options=(
            Option("billing", "payments , invoices and charges", (
                "i was charged twice for my last order .",
                "my invoice shows the wrong amount .",
                "there is an extra fee on my bill that i do not understand .",
                "my card was billed for a plan that i cancelled .",
                "the payment failed but the money left my bank account .",
            )),
            Option("technical", "bugs , errors and crashes", (
                "the app crashes every time i open it .",
                "i get an error message when i upload a file .",
                "the website is very slow and pages do not load .",
                "the app freezes since the latest update .",
                "the sync between my phone and my laptop stopped working .",
            )),
            Option("shipping", "deliveries , parcels and tracking", (
                "my parcel has still not arrived .",
                "the tracking page has not changed for a week .",
                "the box arrived damaged and the item is broken .",
                "the courier left the parcel at the wrong address .",
                "i received the wrong item in my delivery .",
            )),
            Option("account", "login , passwords and profile settings", (
                "i can not log in to my account .",
                "i forgot my password and the reset email never came .",
                "i want to change the email address of my profile .",
                "please close my account and remove my data .",
                "my account was locked after too many login attempts .",
            )),
        ),
    ),
    scale=Scale(
        key="urgency",
        questions=(
            "how urgent is this ticket ?",
            "rate the urgency of the request .",
            "how quickly does the customer need an answer ?",
        ),
        sentences=(
            ("there is no rush on this .", "whenever you have time is fine .", "this can wait until next month ."),
            ("please take a look at this soon .", "i would like an answer this week .",
             "it would be nice to have this sorted in the next few days ."),
            ("this is urgent !", "i need this fixed today .", "please help me right away .",
             "this is blocking my whole team right now ."),
        ),
        level_sets=(
            LevelSet(("low", "medium", "high"), _identity3),
            LevelSet(("can wait", "this week", "right away"), _identity3),
            LevelSet(("not urgent", "somewhat urgent", "very urgent"), _identity3),
        ),
    ),
    facts=(
        Fact("refund",
             ("does the customer ask for a refund ?", "is a refund requested ?",
              "does the customer want their money back ?"),
             ("i would like a refund .", "please refund my money .", "i want my money back ."),
             ("i do not need a refund , i just want it to work .", "no refund is needed ."),
             "the customer asks for a refund", "the customer does not ask for a refund"),
        Fact("order_number",
             ("does the ticket give an order number ?", "is an order number included ?",
              "did the customer provide the order number ?"),
             ("my order number is {n} .", "the order number is {n} .", "it is about order number {n} ."),
             ("i can not find my order number .", "i lost the order number ."),
             "an order number is given", "no order number is given"),
        Fact("contacted_before",
             ("has the customer contacted support before ?", "is this a follow up to an earlier message ?",
              "did the customer already write to us about this ?"),
             ("i already wrote to you last week .", "this is my third message about this .",
              "i called yesterday but nobody helped ."),
             ("this is the first time i contact you .", "i have not written to you before ."),
             "the customer contacted support before", "this is the first contact"),
    ),
    fillers=(
        "i have been a customer for {n} years .",
        "i use your service almost every day .",
        "my colleague {name} told me about your company .",
        "i live in {city} .",
        "i hope you are doing well .",
        "thank you for reading this .",
        "i usually work from home .",
        "my sister {name} also has an account with you .",
        "i like the new design of your home page .",
        "the weather in {city} is nice today .",
        "i am writing from my office .",
        "we are a small team of {n} people .",
        "i read the help page first .",
        "i bought a new phone last year .",
        "my manager {name} asked me to write to you .",
    ),
    openings=("hello ,", "hi team ,", "dear support ,", "good morning ,"),
    closings=("best , {name}", "thanks , {name}", "regards , {name}", "kind regards , {name} from {city}"),
)

CONTRACT = Domain(
    kind="contract",
    category=Category(
        key="contract_type",
        questions=(
            "what kind of contract is this ?",
            "classify this agreement .",
            "which type of agreement is this document ?",
        ),
        options=(
            Option("lease", "renting a flat or an office", (
                "the tenant shall pay the rent on the first day of each month .",
                "the landlord shall keep the flat in good repair .",
                "the tenant may not keep pets in the flat .",
                "the landlord holds a deposit of {n} euros .",
            )),
            Option("employment", "a job with a salary", (
                "the employee shall work {n} hours per week .",
                "the employer shall pay a monthly salary .",
                "the employee is entitled to {n} days of paid holiday .",
                "the employee reports to the head of the department .",
            )),
            Option("service", "work done for a client for a fee", (
                "the provider shall deliver the services described in annex {n} .",
                "the client shall pay the provider for each hour of work .",
                "the provider shall fix any defect in the work within {n} days .",
                "the provider may use subcontractors with the consent of the client .",
            )),
            Option("sale", "buying and selling goods", (
                "the seller shall deliver the goods to the buyer .",
                "the buyer shall pay the purchase price on delivery .",
                "ownership of the goods passes to the buyer on payment .",
                "the seller gives a warranty of {n} months on the goods .",
            )),
        ),
    ),
    scale=Scale(
        key="term_length",
        questions=(
            "how long does this agreement run ?",
            "how long is the term of the contract ?",
            "rate the duration of this agreement .",
        ),
        sentences=(
            ("this agreement runs for {n} *days* .", "the term of this agreement is {n} *weeks* .",
             "this agreement lasts {n} *days* ."),
            ("this agreement runs for {n} *months* .", "the term of this agreement is {n} *months* .",
             "this agreement lasts {n} *months* ."),
            ("this agreement runs for {n} *years* .", "the term of this agreement is {n} *years* .",
             "this agreement lasts {n} *years* ."),
        ),
        level_sets=(
            LevelSet(("short", "medium", "long"), _identity3),
            LevelSet(("days or weeks", "months", "years"), _identity3),
            LevelSet(("under a month", "a month to a year", "more than a year"), _identity3),
        ),
    ),
    facts=(
        Fact("early_termination",
             ("does the contract allow early termination ?", "can a party end this agreement early ?",
              "is early termination possible ?"),
             ("either party may end this agreement early with {n} days notice .",
              "this agreement may be terminated early by written notice ."),
             ("this agreement can not be terminated before the end of the term .",
              "no party may end this agreement early ."),
             "the agreement can be ended early", "the agreement can not be ended early"),
        Fact("confidentiality",
             ("is there a confidentiality clause ?", "must the parties keep the terms secret ?",
              "does the contract require confidentiality ?"),
             ("both parties shall keep the terms of this agreement confidential .",
              "each party must keep all confidential information secret ."),
             ("the terms of this agreement are not confidential .",),
             "the parties must keep things confidential", "nothing is confidential"),
        Fact("late_fee",
             ("is there a penalty for late payment ?", "does a late payment cost a fee ?",
              "does the contract set a late payment fee ?"),
             ("a fee of {n} euros applies to any late payment .",
              "late payments carry a penalty of {n} percent ."),
             ("no penalty applies to late payment .",),
             "late payment costs a fee", "late payment costs nothing extra"),
        Fact("auto_renewal",
             ("does the agreement renew automatically ?", "is there an automatic renewal ?",
              "will the contract extend by itself at the end of the term ?"),
             ("the agreement renews automatically at the end of the term .",
              "unless cancelled , this agreement extends by itself for the same term ."),
             ("the agreement does not renew automatically .", "this agreement ends at the end of the term ."),
             "it renews automatically", "it does not renew"),
    ),
    fillers=(
        "this agreement is made between {name} and {company} .",
        "the parties have read this agreement .",
        "this agreement is governed by the law of the place of signature .",
        "any notice must be sent by email .",
        "headings are for convenience only .",
        "signed in {city} on {n} june .",
        "annex {n} forms part of this agreement .",
        "changes to this agreement must be made in writing .",
        "if one clause is invalid , the other clauses remain valid .",
        "{company} is represented by {name} .",
        "each party bears its own costs .",
        "this agreement is written in english .",
        "the parties will try to settle any dispute in good faith .",
        "the address of {company} is in {city} .",
    ),
    openings=("agreement", "contract", "agreement between the parties"),
    closings=("signed , {name}", "for {company} , {name}"),
)

REVIEW = Domain(
    kind="review",
    category=Category(
        key="product_category",
        questions=(
            "what kind of product is reviewed ?",
            "which category does the product belong to ?",
            "in which shop section would you find this product ?",
        ),
        options=(
            Option("electronics", "devices with a battery or a plug", (
                "i bought this *{thing}* last month .", "the battery of the *{thing}* lasts {n} hours .",
                "the *{thing}* connects to my laptop .",
            ), ("phone", "laptop", "speaker", "headphones", "camera", "tablet")),
            Option("clothing", "things to wear", (
                "i bought this *{thing}* last month .", "i usually wear size medium and this *{thing}* fits .",
                "the *{thing}* can go in the washing machine .",
            ), ("jacket", "shirt", "shoes", "dress", "scarf", "sweater")),
            Option("kitchen", "tools for cooking", (
                "i bought this *{thing}* last month .", "i use the *{thing}* to make soup .",
                "the *{thing}* is easy to clean after cooking .",
            ), ("blender", "pan", "kettle", "toaster", "knife", "pot")),
            Option("books", "things to read", (
                "i bought this *{thing}* last month .", "the *{thing}* has {n} chapters .",
                "i read the *{thing}* on the train .",
            ), ("novel", "cookbook", "biography", "book", "comic", "atlas")),
        ),
    ),
    scale=Scale(
        key="rating",
        questions=(
            "how satisfied is the reviewer ?",
            "what rating does this review give ?",
            "how positive is this review ?",
        ),
        sentences=(
            ("this is the worst purchase i have ever made .", "it is completely useless .",
             "total waste of money .", "i hate it ."),
            ("i am disappointed with it .", "it is below my expectations .", "it is rather poor .",
             "sadly it broke after a few uses ."),
            ("it is okay .", "it is fine for the price but nothing special .",
             "some things are good and some are bad .", "it is average ."),
            ("i like it .", "it works well .", "i am happy with it .", "it does the job nicely ."),
            ("i absolutely love it !", "it is perfect .", "best purchase of the year !",
             "it is excellent in every way ."),
        ),
        level_sets=(
            LevelSet(("terrible", "poor", "okay", "good", "excellent"), (0, 1, 2, 3, 4)),
            LevelSet(("1 star", "2 stars", "3 stars", "4 stars", "5 stars"), (0, 1, 2, 3, 4)),
            LevelSet(("negative", "mixed", "positive"), (0, 0, 1, 2, 2)),
        ),
    ),
    facts=(
        Fact("mentions_price",
             ("does the reviewer mention the price ?", "is the price given in the review ?",
              "does the review say what it cost ?"),
             ("it cost {n} euros .", "the price was {n} dollars .", "i paid {n} euros for it ."),
             ("i got it as a gift so i do not know the price .",),
             "the price is mentioned", "the price is not mentioned"),
        Fact("late_delivery",
             ("did the product arrive late ?", "was the delivery late ?",
              "did the order take longer than promised ?"),
             ("it arrived {n} days late .", "delivery took much longer than promised ."),
             ("it arrived on time .", "delivery was fast ."),
             "the delivery was late", "the delivery was on time or not mentioned"),
        Fact("recommends",
             ("would the reviewer recommend it ?", "does the reviewer recommend this product ?",
              "is this a recommendation ?"),
             ("i would recommend it to anyone .", "i recommend this to my friends ."),
             ("i would not recommend it .", "i can not recommend this ."),
             "the reviewer recommends it", "the reviewer does not recommend it"),
        Fact("returned",
             ("did the reviewer send the product back ?", "was the item returned ?",
              "did the reviewer return it ?"),
             ("i sent it back the next day .", "i returned it to the shop ."),
             ("i decided to keep it .", "i did not return it ."),
             "the product was returned", "the product was kept"),
    ),
    fillers=(
        "i ordered it on a sunday .",
        "my friend {name} has the same one .",
        "the box was blue .",
        "i live in {city} .",
        "i have bought from this shop {n} times .",
        "my daughter picked the colour .",
        "the instructions were in {n} languages .",
        "i read a few other reviews first .",
        "the parcel came with a small card .",
        "i use it every day .",
        "we are a family of {n} .",
        "i also bought a bag from {company} .",
        "my husband {name} wanted one too .",
    ),
    openings=("review", "my review", "customer review by {name}"),
    closings=("written by {name}", "{name} from {city}"),
)

DOMAINS = (TICKET, CONTRACT, REVIEW)

# Words the prompt builder or the generator writes outside these sentences.
EXTRA_WORDS = ("no", "yes", ":", "no rush")
