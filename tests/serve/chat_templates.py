"""Chat templates that behave like the released Qwen3 and Qwen3.5 ones in what the server relies on.

- QWEN3: tools listed in the system turn as JSON inside `<tools>`; assistant tool calls rendered as
  `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`; tool results as `<tool_response>` in a user turn;
  `enable_thinking=False` closes an empty `<think></think>` in the generation prompt.
- QWEN3_5: the XML call format `<tool_call>\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n</function>\n
  </tool_call>`; the generation prompt opens `<think>\n` (thinking on by default); history reasoning is dropped
  for assistant turns before the last user message unless `preserve_thinking` is true.
"""

_COMMON_HEAD = (
    '{%- if tools %}'
    '{{- "<|im_start|>system\\n" }}'
    '{%- if messages[0].role == "system" %}{{- messages[0].content + "\\n\\n" }}{%- endif %}'
    '{{- "# Tools\\n\\nYou may call one or more functions.\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" + (tool | tojson) }}{%- endfor %}'
    '{{- "\\n</tools>\\n" + CALL_HINT + "<|im_end|>\\n" }}'
    '{%- elif messages[0].role == "system" %}'
    '{{- "<|im_start|>system\\n" + messages[0].content + "<|im_end|>\\n" }}'
    '{%- endif %}'
    '{%- set ns = namespace(last_query=-1) %}'
    '{%- for m in messages %}{%- if m.role == "user" %}{%- set ns.last_query = loop.index0 %}{%- endif %}'
    '{%- endfor %}'
)

_LOOP = (
    '{%- for m in messages %}'
    '{%- set content = m.content if m.content is string else "" %}'
    '{%- if m.role == "user" or (m.role == "system" and not loop.first) %}'
    '{{- "<|im_start|>" + m.role + "\\n" + content + "<|im_end|>\\n" }}'
    '{%- elif m.role == "assistant" %}'
    '{%- set reasoning = m.reasoning_content if m.reasoning_content is string else "" %}'
    '{%- if not reasoning and "</think>" in content %}'
    '{%- set reasoning = content.split("</think>")[0].split("<think>")[-1] %}'
    '{%- set content = content.split("</think>")[-1] %}'
    '{%- endif %}'
    '{{- "<|im_start|>assistant\\n" }}'
    '{%- if loop.index0 > ns.last_query or KEEP_THINKING %}'
    '{{- "<think>\\n" + reasoning.strip("\\n") + "\\n</think>\\n\\n" + content.lstrip("\\n") }}'
    '{%- else %}{{- content.lstrip("\\n") }}{%- endif %}'
    '{%- for call in m.tool_calls or [] %}{%- set f = call.function if call.function else call %}'
    'CALL_BODY'
    '{%- endfor %}'
    '{{- "<|im_end|>\\n" }}'
    '{%- elif m.role == "tool" %}'
    '{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- "<|im_start|>user" }}{%- endif %}'
    '{{- "\\n<tool_response>\\n" + content + "\\n</tool_response>" }}'
    '{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- "<|im_end|>\\n" }}{%- endif %}'
    '{%- endif %}'
    '{%- endfor %}'
)

_JSON_CALL = (
    '{{- "\\n<tool_call>\\n{\\"name\\": \\"" + f.name + "\\", \\"arguments\\": " }}'
    '{{- (f.arguments if f.arguments is string else (f.arguments | tojson)) + "}\\n</tool_call>" }}'
)
_XML_CALL = (
    '{{- "\\n<tool_call>\\n<function=" + f.name + ">\\n" }}'
    '{%- for k, v in f.arguments | items %}'
    '{{- "<parameter=" + k + ">\\n" + (v if v is string else (v | tojson)) + "\\n</parameter>\\n" }}'
    '{%- endfor %}{{- "</function>\\n</tool_call>" }}'
)

QWEN3 = (
    (_COMMON_HEAD + _LOOP)
    .replace('CALL_HINT', '"Answer with <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call>."')
    .replace('KEEP_THINKING', 'false').replace('CALL_BODY', _JSON_CALL)
    + '{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}'
      '{%- if enable_thinking is defined and not enable_thinking %}{{- "<think>\\n\\n</think>\\n\\n" }}{%- endif %}'
      '{%- endif %}'
)
QWEN3_5 = (
    (_COMMON_HEAD + _LOOP)
    .replace('CALL_HINT', '"Answer with <tool_call><function=NAME><parameter=K>V</parameter></function></tool_call>."')
    .replace('KEEP_THINKING', '(preserve_thinking is defined and preserve_thinking)').replace('CALL_BODY', _XML_CALL)
    + '{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}'
      '{%- if enable_thinking is defined and not enable_thinking %}{{- "<think>\\n\\n</think>\\n\\n" }}'
      '{%- else %}{{- "<think>\\n" }}{%- endif %}'
      '{%- endif %}'
)

# Generation prompts the scripted models must answer (their last token triggers the script).
QWEN3_PROMPT_ENDS = ['<|im_end|>\n<|im_start|>assistant\n', '<|im_start|>assistant\n<think>\n\n</think>\n\n']
QWEN3_5_PROMPT_ENDS = ['<|im_start|>assistant\n<think>\n']
