"""kvlend inside vLLM.

``kvlend_vllm.connector.KvlendConnector`` is the KV connector (load it with
``kv_connector_module_path="kvlend_vllm.connector"``); ``router`` is the
prefill-then-decode HTTP proxy; ``models`` builds local test models;
``launch`` starts and stops servers by process group.  Only ``connector``
and ``router`` import vLLM's environment; ``layout`` is pure.
"""
