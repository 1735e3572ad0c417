"""The request parts of structured output and tool calls (response_format, structured_outputs, tools,
tool_choice, an assistant's tool_calls), apart from protocol.py's bodies that hold them."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Every body part: strict types, unknown fields refused (a 400 that names them)."""
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[bool] = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(Strict):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema' and only allowed with it")
        return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a list of choices, a Lark grammar."""
    json_: Union[dict, str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
