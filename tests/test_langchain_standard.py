"""LangChain's own standard test suites (langchain-tests) run against ChatOpenJet.

The integration suite runs on the embedded default model: random weights, so the replies are
gibberish, but every call goes through the real engine (template, generation, usage, streaming).

Declared off, and why (each is covered by a deterministic test in test_adapter_langchain.py that
feeds crafted model output through the same code):
- tool-calling tests that need the model to *choose* to call a tool (test_tool_calling*,
  test_tool_choice, test_tool_calling_with_no_arguments, test_bind_runnables_as_tools,
  test_agent_loop, test_unicode_tool_call_integration): a random-weight model does not call tools.
- structured-output tests (test_structured_output*, test_json_mode): they need the model to write
  a valid call / JSON; there is no grammar-constrained decoding to force it.
Tool *histories* (AIMessage.tool_calls and ToolMessages going back into the template) do run:
test_tool_message_histories_*, test_tool_message_error_status, test_structured_few_shot_examples.
Image/audio/PDF inputs are off: the model reads text only.
"""

from __future__ import annotations

import inspect

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from openjet_plugin import default_model_path
from openjet_plugin.adapters.langchain import ChatOpenJet

_NEEDS_A_TRAINED_MODEL = "a random-weight model does not choose to call tools or write valid JSON"


class TestChatOpenJetUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatOpenJet]:
        return ChatOpenJet

    @property
    def chat_model_params(self) -> dict:
        # unit tests never load the model: construction is lazy
        return {"model": "default"}


class TestChatOpenJetIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatOpenJet]:
        return ChatOpenJet

    @property
    def chat_model_params(self) -> dict:
        return {"model": str(default_model_path()), "temperature": 0, "max_tokens": 24}

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        # the engine reuses the longest common prefix with the previous request: ask twice
        model = ChatOpenJet(**self.chat_model_params)
        model.invoke("Tell me about caches.")
        if stream:
            full = None
            for chunk in model.stream("Tell me about caches."):
                full = chunk if full is None else full + chunk
            return full
        return model.invoke("Tell me about caches.")

    @property
    def model_override_value(self) -> str:
        # the alias of the same file: loads nothing new, and response_metadata names it
        return "default"

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return False

    # --- declared off: need a model that decides to call a tool or write valid JSON (see the
    # module docstring). LangChain's convention for a standard test a model cannot pass is an
    # xfail with a reason; run=False because the outcome is known without spending the time.
    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_tool_calling(self, model) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    async def test_tool_calling_async(self, model) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_tool_choice(self, model) -> None:
        super().test_tool_choice(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_tool_calling_with_no_arguments(self, model) -> None:
        super().test_tool_calling_with_no_arguments(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_bind_runnables_as_tools(self, model) -> None:
        super().test_bind_runnables_as_tools(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_unicode_tool_call_integration(self, model) -> None:
        super().test_unicode_tool_call_integration(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_structured_output(self, model, schema_type) -> None:
        super().test_structured_output(model, schema_type)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    async def test_structured_output_async(self, model, schema_type) -> None:
        await super().test_structured_output_async(model, schema_type)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_structured_output_pydantic_2_v1(self, model) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @pytest.mark.xfail(reason=_NEEDS_A_TRAINED_MODEL, run=False)
    def test_structured_output_optional_param(self, model) -> None:
        super().test_structured_output_optional_param(model)


# The suite's async tests are plain `async def`s (LangChain runs them with asyncio_mode=auto);
# mark them for pytest-asyncio's default strict mode. The mark goes on the suite's own function
# object, so the class still runs the standard test itself, not an override.
for _name, _fn in inspect.getmembers(TestChatOpenJetIntegration, inspect.iscoroutinefunction):
    if _name.startswith("test_"):
        pytest.mark.asyncio(_fn)
