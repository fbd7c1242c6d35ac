"""Framework adapters: thin translations between a framework's types and `openjet_plugin.Engine`.

- `openjet_plugin.adapters.langchain`: `ChatOpenJet` (chat model) and `OpenJetLLM` (text LLM)
- `openjet_plugin.adapters.litellm`: `OpenJetProvider` (LiteLLM custom provider "openjet") + `register()`
- `openjet_plugin.adapters.llama_cpp`: `Llama`, a drop-in for `llama_cpp.Llama`

Each module imports only its own framework, so using one does not pull in the others.
"""
