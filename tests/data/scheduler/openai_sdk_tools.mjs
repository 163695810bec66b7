// The OpenAI Node SDK's `tools` flow against pd-scheduler (docs/api.md "Tool calling"). Usage:
//   node openai_sdk_tools.mjs <base url with --enable-auto-tool-choice --tool-call-parser hermes>
//                             <base url without them> <model> <model directory>
// With the flags: tools with tool_choice auto (and unset) are accepted, the reply is a chat
// completion whose message has content and a tool_calls list, and under greedy the streamed
// deltas rebuild the non-streamed message (both went through the parser); a history with an
// assistant's tool_calls and a tool result is accepted. tool_choice "required" (structured
// output makes the answer a list of calls): finish_reason "tool_calls", content "", each call of
// the tool with JSON-object arguments, the streamed calls equal to the non-streamed ones (same
// seed); a named function: one call of it, finish_reason "stop". Without the flags: auto is
// refused with vLLM's message, "none" is served. The SDK is loaded from $PD_NPM_CACHE/node_modules (tests/npm_cache.sh openai@4).
// Prints one JSON line; exits 1 on any mismatch.
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';

const require = createRequire(`${process.env.PD_NPM_CACHE}/node_modules/`);
const OpenAI = require('openai');
const [withURL, withoutURL, model, modelDir] = process.argv.slice(2);
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
// tool_choice "required" and named: served, by the SDK's types (the random model is steered off
// whitespace-only tokens, which JSON allows anywhere, so that it finishes within max_tokens)
const tok = JSON.parse(readFileSync(`${modelDir}/tokenizer.json`, 'utf8'));
const logit_bias = Object.fromEntries(Object.entries(tok.model.vocab)
  .filter(([k]) => /^[\u0120\u010a\u0109\u010d]+$/.test(k)).map(([, id]) => [id, -100]));
const forced = { model, messages, tools, temperature: 1, seed: 3, max_tokens: 200, logit_bias };
const req = await on.chat.completions.create({ ...forced, tool_choice: 'required' });
const rmsg = req.choices[0].message;
if (req.choices[0].finish_reason !== 'tool_calls' || rmsg.content !== '' || !rmsg.tool_calls.length)
  fail(`required: ${JSON.stringify(req.choices[0])}`);
for (const c of rmsg.tool_calls) {
  const a = JSON.parse(c.function.arguments);
  if (c.function.name !== 'get_weather' || typeof a !== 'object' || typeof a.city !== 'string')
    fail(`required call ${JSON.stringify(c)}`);
}
const rcalls = [];
let rfinish = null;
for await (const chunk of await on.chat.completions.create({ ...forced, tool_choice: 'required', stream: true })) {
  for (const ch of chunk.choices) {
    for (const t of ch.delta.tool_calls ?? []) {
      if (t.id) rcalls[t.index] = { name: t.function.name, arguments: t.function.arguments ?? '' };
      else rcalls[t.index].arguments += t.function.arguments ?? '';
    }
    if (ch.finish_reason) rfinish = ch.finish_reason;
  }
}
if (rfinish !== 'tool_calls' || JSON.stringify(rcalls) !== JSON.stringify(rmsg.tool_calls.map((c) => c.function)))
  fail(`streamed required ${rfinish} ${JSON.stringify(rcalls)}`);
const named = await on.chat.completions.create({ ...forced,
  tool_choice: { type: 'function', function: { name: 'get_weather' } } });
const nmsg = named.choices[0].message;
if (named.choices[0].finish_reason !== 'stop' || nmsg.content !== '' || nmsg.tool_calls.length !== 1 ||
    nmsg.tool_calls[0].function.name !== 'get_weather' ||
    typeof JSON.parse(nmsg.tool_calls[0].function.arguments).city !== 'string')
  fail(`named: ${JSON.stringify(named.choices[0])}`);
const vllm = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set';
await refused(off, { ...greedy, tool_choice: 'auto' }, 400, vllm);
await refused(off, greedy, 400, vllm);
const none = await off.chat.completions.create({ ...greedy, tool_choice: 'none' });
if (typeof none.choices[0].message.content !== 'string') fail('tool_choice none');

console.log(JSON.stringify({ ok: true, content: msg.content, tool_calls: msg.tool_calls,
  required: rmsg.tool_calls }));
