// The OpenAI Node SDK's `tools` flow against pd-scheduler (docs/api.md "Tool calling"). Usage:
//   node openai_sdk_tools.mjs <base url with --enable-auto-tool-choice --tool-call-parser hermes>
//                             <base url without them> <model>
// With the flags: tools with tool_choice auto (and unset) are accepted, the reply is a chat
// completion whose message has content and a tool_calls list, and under greedy the streamed
// deltas rebuild the non-streamed message (both went through the parser); a history with an
// assistant's tool_calls and a tool result is accepted; "required" and a named function are
// refused naming `tool_choice`. Without the flags: auto is refused with vLLM's message, "none"
// is served. The SDK is loaded from $PD_NPM_CACHE/node_modules (tests/npm_cache.sh openai@4).
// Prints one JSON line; exits 1 on any mismatch.
import { createRequire } from 'node:module';

const require = createRequire(`${process.env.PD_NPM_CACHE}/node_modules/`);
const OpenAI = require('openai');
const [withURL, withoutURL, model] = process.argv.slice(2);
const opts = { apiKey: 'sk-none', maxRetries: 0, timeout: 60000 };
const on = new OpenAI({ baseURL: withURL, ...opts });
const off = new OpenAI({ baseURL: withoutURL, ...opts });
const fail = (msg) => { console.log(JSON.stringify({ ok: false, error: msg })); process.exit(1); };

const tools = [{
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Current weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  },
}];
const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
const greedy = { model, messages, tools, temperature: 0, max_tokens: 12 };

// accepted: auto, explicit and implied
const full = await on.chat.completions.create({ ...greedy, tool_choice: 'auto' });
const msg = full.choices[0].message;
if (msg.role !== 'assistant' || !Array.isArray(msg.tool_calls)) fail(`message ${JSON.stringify(msg)}`);
const called = msg.tool_calls.length > 0;
if (called !== (full.choices[0].finish_reason === 'tool_calls'))
  fail(`finish_reason ${full.choices[0].finish_reason} with ${msg.tool_calls.length} calls`);
for (const c of msg.tool_calls) {
  if (c.type !== 'function' || !c.id.startsWith('chatcmpl-tool-')) fail(`call ${JSON.stringify(c)}`);
  JSON.parse(c.function.arguments);
}
const implied = await on.chat.completions.create(greedy);
if (implied.choices[0].message.content !== msg.content) fail('tool_choice unset is not auto');

// streaming: the deltas rebuild the message (content and calls), the final chunk's finish_reason
let content = null;
const calls = [];
let finish = null;
const stream = await on.chat.completions.create({ ...greedy, tool_choice: 'auto', stream: true });
for await (const chunk of stream) {
  for (const ch of chunk.choices) {
    const d = ch.delta;
    if (d.content != null) content = (content ?? '') + d.content;
    for (const t of d.tool_calls ?? []) {
      if (t.id) calls[t.index] = { name: t.function.name, arguments: t.function.arguments ?? '' };
      else calls[t.index].arguments += t.function.arguments ?? '';
    }
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
if ((content || null) !== (msg.content || null))
  fail(`streamed content ${JSON.stringify(content)} != ${JSON.stringify(msg.content)}`);
if (JSON.stringify(calls) !== JSON.stringify(msg.tool_calls.map((c) => c.function)))
  fail(`streamed calls ${JSON.stringify(calls)}`);
if (finish !== full.choices[0].finish_reason) fail(`streamed finish_reason ${finish}`);

// n > 1: every choice has its own parser
const many = await on.chat.completions.create({ ...greedy, n: 2, temperature: 1, seed: 5 });
if (many.choices.length !== 2 || many.choices.some((c) => !Array.isArray(c.message.tool_calls)))
  fail('n=2');

// a history with an assistant's tool call (arguments as a JSON string) and the tool's answer
const history = [
  ...messages,
  { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function',
    function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
  { role: 'tool', tool_call_id: 'call_1', content: '18 C, sunny' },
];
const after = await on.chat.completions.create({ ...greedy, messages: history });
if (typeof after.choices[0].message.content !== 'string' && !after.choices[0].message.tool_calls.length)
  fail('history with a tool result');

const refused = async (client, body, status, text) => {
  try {
    await client.chat.completions.create(body);
  } catch (e) {
    if (!(e instanceof OpenAI.APIError) || e.status !== status || !String(e.message).includes(text))
      fail(`${JSON.stringify(body.tool_choice)}: ${e}`);
    return String(e.message);
  }
  fail(`${JSON.stringify(body.tool_choice)} accepted`);
};
const required = await refused(on, { ...greedy, tool_choice: 'required' }, 400, '`tool_choice`');
await refused(on, { ...greedy, tool_choice: { type: 'function', function: { name: 'get_weather' } } },
  400, '`tool_choice`');
const vllm = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set';
await refused(off, { ...greedy, tool_choice: 'auto' }, 400, vllm);
await refused(off, greedy, 400, vllm);
const none = await off.chat.completions.create({ ...greedy, tool_choice: 'none' });
if (typeof none.choices[0].message.content !== 'string') fail('tool_choice none');

console.log(JSON.stringify({ ok: true, content: msg.content, tool_calls: msg.tool_calls, required }));
