// Drives pd-scheduler with the official OpenAI Node SDK (docs/api.md §18 acceptance):
// models.list, completions.create and chat.completions.create, streaming and not; under greedy
// the streamed text must equal the non-streamed text. Usage:
//   node openai_sdk.mjs <base url, e.g. http://127.0.0.1:8000/v1> <model>
// The SDK is loaded from $PD_NPM_CACHE/node_modules (tests/npm_cache.sh openai@4).
// Prints one JSON line with what it saw; exits 1 on any mismatch.
import { createRequire } from 'node:module';

const cache = process.env.PD_NPM_CACHE;
const require = createRequire(`${cache}/node_modules/`);
const OpenAI = require('openai');
const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'sk-none', maxRetries: 0, timeout: 60000 });

const fail = (msg) => { console.log(JSON.stringify({ ok: false, error: msg })); process.exit(1); };

const models = await client.models.list();
const ids = models.data.map((m) => m.id);
if (!ids.includes(model)) fail(`models.list: ${JSON.stringify(ids)}`);

const greedy = { temperature: 0, max_tokens: 10, ignore_eos: true };
const full = await client.completions.create({ model, prompt: 'The capital of France is', ...greedy });
const fullText = full.choices[0].text;
if (full.usage.completion_tokens !== 10) fail(`completions usage ${JSON.stringify(full.usage)}`);
let streamed = '';
let chunks = 0;
const cs = await client.completions.create({ model, prompt: 'The capital of France is', ...greedy, stream: true });
for await (const c of cs) { for (const ch of c.choices) { streamed += ch.text; chunks++; } }
if (streamed !== fullText) fail(`completions: streamed ${JSON.stringify(streamed)} != ${JSON.stringify(fullText)}`);
if (chunks !== 10) fail(`completions: ${chunks} token chunks`);

const messages = [{ role: 'user', content: 'Say hello' }];
const chat = await client.chat.completions.create({ model, messages, ...greedy });
const chatText = chat.choices[0].message.content;
if (chat.choices[0].message.role !== 'assistant') fail('chat role');
let chatStreamed = '';
let usage = null;
const ss = await client.chat.completions.create({ model, messages, ...greedy, stream: true, stream_options: { include_usage: true } });
for await (const c of ss) {
  for (const ch of c.choices) chatStreamed += ch.delta.content ?? '';
  if (c.usage) usage = c.usage;
}
if (chatStreamed !== chatText) fail(`chat: streamed ${JSON.stringify(chatStreamed)} != ${JSON.stringify(chatText)}`);
if (!usage || usage.completion_tokens !== 10) fail(`chat usage ${JSON.stringify(usage)}`);

// errors surface as the SDK's typed errors with the contract's status
try {
  await client.completions.create({ model: 'gpt-4', prompt: 'x' });
  fail('unknown model accepted');
} catch (e) {
  if (!(e instanceof OpenAI.NotFoundError)) fail(`unknown model: ${e}`);
}
console.log(JSON.stringify({ ok: true, models: ids, completion: fullText, chat: chatText }));
