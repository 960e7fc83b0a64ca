"""Example requests for the README's main job, and how their answers are printed.

Four documents a reader can check by eye (a JSON ticket, a plain-text ticket, a contract, a
product review), each with questions of all three types. `expected` holds the answer a careful
reader gives; `tests/demo/test_demo_model.py` checks the demo model gives the same argmax answers.
The words all come from the demo vocabulary (`kev.demo.tasks.vocabulary`): the tiny model knows
no others.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

from kev.request.api import Answer, ChoiceAnswer, NoulAnswer, Question, ScoreRequest
from kev.request.prompts import render_document

TEAMS = {"billing": "payments , invoices and charges", "technical": "bugs , errors and crashes",
         "shipping": "deliveries , parcels and tracking", "account": "login , passwords and profile settings"}


@dataclass(frozen=True)
class DemoExample:
    title: str
    request: ScoreRequest
    expected: dict[str, str]  # question name -> "yes"/"no", the option name, or the level description


EXAMPLES: tuple[DemoExample, ...] = (
    DemoExample(
        "support ticket (JSON)",
        ScoreRequest(
            document={"customer": "anna", "message": (
                "hello , i was charged twice for my last order . my card was billed for a plan that i "
                "cancelled . i can not find my order number . i already wrote to you last week . "
                "i need this fixed today . i would like a refund . thanks , anna")},
            questions={
                "team": Question.choice("which team should handle this ticket ?", TEAMS),
                "urgency": Question.score("how urgent is this ticket ?", ["low", "medium", "high"]),
                "refund": Question.noul("does the customer ask for a refund ?"),
                "order_number": Question.noul("does the ticket give an order number ?"),
                "contacted_before": Question.noul("has the customer contacted support before ?"),
            },
        ),
        {"team": "billing", "urgency": "high", "refund": "yes", "order_number": "no",
         "contacted_before": "yes"},
    ),
    DemoExample(
        "support ticket",
        ScoreRequest(
            document=("hi team , the app crashes every time i open it . i use your service almost every day "
                      ". my order number is 17 . this is the first time i contact you . there is no rush on "
                      "this . best , jonas"),
            questions={
                "team": Question.choice("route this ticket to the right team .", dict.fromkeys(TEAMS)),
                "urgency": Question.score("how quickly does the customer need an answer ?",
                                          ["can wait", "this week", "right away"]),
                "refund": Question.noul("is a refund requested ?"),
                "contacted_before": Question.noul("is this a follow up to an earlier message ?"),
            },
        ),
        {"team": "technical", "urgency": "can wait", "refund": "no", "contacted_before": "no"},
    ),
    DemoExample(
        "contract",
        ScoreRequest(
            document=("agreement between the parties . this agreement is made between ben and acme . the "
                      "tenant shall pay the rent on the first day of each month . the landlord holds a deposit "
                      "of 50 euros . this agreement runs for 3 years . either party may end this agreement early "
                      "with 30 days notice . a fee of 20 euros applies to any late payment . the agreement does "
                      "not renew automatically . signed in vienna on 12 june ."),
            questions={
                "contract_type": Question.choice("what kind of contract is this ?", {
                    "lease": "renting a flat or an office", "employment": "a job with a salary",
                    "service": "work done for a client for a fee", "sale": "buying and selling goods"}),
                "term_length": Question.score("how long is the term of the contract ?",
                                              ["short", "medium", "long"]),
                "early_termination": Question.noul("does the contract allow early termination ?"),
                "late_fee": Question.noul("is there a penalty for late payment ?"),
                "auto_renewal": Question.noul("does the agreement renew automatically ?"),
                "confidentiality": Question.noul("is there a confidentiality clause ?"),
            },
        ),
        {"contract_type": "lease", "term_length": "long", "early_termination": "yes", "late_fee": "yes",
         "auto_renewal": "no", "confidentiality": "no"},
    ),
    DemoExample(
        "product review",
        ScoreRequest(
            document=("customer review by carla . i bought this kettle last month . the kettle is easy to clean "
                      "after cooking . it is fine for the price but nothing special . it arrived 5 days late . "
                      "i paid 30 euros for it . i decided to keep it . i would not recommend it ."),
            questions={
                "product_category": Question.choice("which category does the product belong to ?",
                                                    dict.fromkeys(["electronics", "clothing", "kitchen", "books"])),
                "rating": Question.score("what rating does this review give ?",
                                         ["1 star", "2 stars", "3 stars", "4 stars", "5 stars"]),
                "late_delivery": Question.noul("did the product arrive late ?"),
                "mentions_price": Question.noul("does the reviewer mention the price ?"),
                "recommends": Question.noul("would the reviewer recommend it ?"),
                "returned": Question.noul("was the item returned ?"),
            },
        ),
        {"product_category": "kitchen", "rating": "3 stars", "late_delivery": "yes", "mentions_price": "yes",
         "recommends": "no", "returned": "no"},
    ),
)


def answer_label(answer: Answer) -> str:
    """The argmax answer as a reader would say it: yes/no, the option name, the level description."""
    if isinstance(answer, NoulAnswer):
        return "yes" if answer.p_yes > 0.5 else "no"
    if isinstance(answer, ChoiceAnswer):
        return answer.choice
    mode = max(range(len(answer.probabilities)), key=answer.probabilities.__getitem__)
    return answer.legend[mode]


def format_answer(answer: Answer) -> str:
    label = answer_label(answer)
    if isinstance(answer, NoulAnswer):
        return f"{label:<12} p(yes) = {answer.p_yes:.3f}"
    if isinstance(answer, ChoiceAnswer):
        probs = ", ".join(f"{k} {v:.2f}" for k, v in answer.probabilities.items())
        return f"{label:<12} confidence {answer.confidence:.2f}  ({probs})"
    probs = ", ".join(f"{i}: {p:.2f}" for i, p in enumerate(answer.probabilities))
    return f"{label:<12} score {answer.score:.2f}, confidence {answer.confidence:.2f}  ({probs})"


def format_example(example: DemoExample, answers: dict[str, Answer]) -> str:
    text = render_document(example.request.document)
    lines = [f"== {example.title} ==",
             *(textwrap.fill(line, 96, initial_indent="  | ", subsequent_indent="  | ") for line in text.split("\n"))]
    width = max(len(name) for name in example.request.questions)
    for name, question in example.request.questions.items():
        lines.append(f"  {question.instructions}")
        lines.append(f"    {name:<{width}}  -> {format_answer(answers[name])}")
    return "\n".join(lines)


def format_all(examples: Sequence[DemoExample], responses: Sequence) -> str:
    return "\n\n".join(format_example(ex, r.answers) for ex, r in zip(examples, responses, strict=True))
