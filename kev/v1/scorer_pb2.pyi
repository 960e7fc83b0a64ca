from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreQuestionsRequest(_message.Message):
    __slots__ = ("model", "document_text", "document_json", "questions", "truncate_document")
    class QuestionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Question
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Question, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_TEXT_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_JSON_FIELD_NUMBER: _ClassVar[int]
    QUESTIONS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_DOCUMENT_FIELD_NUMBER: _ClassVar[int]
    model: str
    document_text: str
    document_json: str
    questions: _containers.MessageMap[str, Question]
    truncate_document: bool
    def __init__(self, model: _Optional[str] = ..., document_text: _Optional[str] = ..., document_json: _Optional[str] = ..., questions: _Optional[_Mapping[str, Question]] = ..., truncate_document: _Optional[bool] = ...) -> None: ...

class Question(_message.Message):
    __slots__ = ("type", "instructions", "true_description", "false_description", "options", "levels")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[Question.Type]
        NOUL: _ClassVar[Question.Type]
        CHOICE: _ClassVar[Question.Type]
        SCORE: _ClassVar[Question.Type]
    TYPE_UNSPECIFIED: Question.Type
    NOUL: Question.Type
    CHOICE: Question.Type
    SCORE: Question.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    TRUE_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    FALSE_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    type: Question.Type
    instructions: str
    true_description: str
    false_description: str
    options: _containers.RepeatedCompositeFieldContainer[Option]
    levels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, type: _Optional[_Union[Question.Type, str]] = ..., instructions: _Optional[str] = ..., true_description: _Optional[str] = ..., false_description: _Optional[str] = ..., options: _Optional[_Iterable[_Union[Option, _Mapping]]] = ..., levels: _Optional[_Iterable[str]] = ...) -> None: ...

class Option(_message.Message):
    __slots__ = ("name", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("noul", "choice", "score")
    NOUL_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    noul: NoulAnswer
    choice: ChoiceAnswer
    score: ScoreAnswer
    def __init__(self, noul: _Optional[_Union[NoulAnswer, _Mapping]] = ..., choice: _Optional[_Union[ChoiceAnswer, _Mapping]] = ..., score: _Optional[_Union[ScoreAnswer, _Mapping]] = ...) -> None: ...

class NoulAnswer(_message.Message):
    __slots__ = ("p_yes",)
    P_YES_FIELD_NUMBER: _ClassVar[int]
    p_yes: float
    def __init__(self, p_yes: _Optional[float] = ...) -> None: ...

class ChoiceAnswer(_message.Message):
    __slots__ = ("choice", "probabilities", "confidence")
    class ProbabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    choice: str
    probabilities: _containers.ScalarMap[str, float]
    confidence: float
    def __init__(self, choice: _Optional[str] = ..., probabilities: _Optional[_Mapping[str, float]] = ..., confidence: _Optional[float] = ...) -> None: ...

class ScoreAnswer(_message.Message):
    __slots__ = ("score", "legend", "probabilities", "confidence")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LEGEND_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    score: float
    legend: _containers.RepeatedScalarFieldContainer[str]
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    confidence: float
    def __init__(self, score: _Optional[float] = ..., legend: _Optional[_Iterable[str]] = ..., probabilities: _Optional[_Iterable[float]] = ..., confidence: _Optional[float] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "cached_state_tokens", "document_tokens", "truncated", "unknown_tokens")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_STATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    cached_state_tokens: int
    document_tokens: int
    truncated: bool
    unknown_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ..., cached_state_tokens: _Optional[int] = ..., document_tokens: _Optional[int] = ..., truncated: _Optional[bool] = ..., unknown_tokens: _Optional[int] = ...) -> None: ...

class ScoreQuestionsResponse(_message.Message):
    __slots__ = ("answers", "usage", "model_ms", "model")
    class AnswersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Answer
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Answer, _Mapping]] = ...) -> None: ...
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_MS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.MessageMap[str, Answer]
    usage: Usage
    model_ms: float
    model: str
    def __init__(self, answers: _Optional[_Mapping[str, Answer]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., model_ms: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_document_tokens", "max_row_tokens", "is_default")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_DOCUMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_document_tokens: int
    max_row_tokens: int
    is_default: bool
    def __init__(self, id: _Optional[str] = ..., max_document_tokens: _Optional[int] = ..., max_row_tokens: _Optional[int] = ..., is_default: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
