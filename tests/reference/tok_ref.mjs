#!/usr/bin/env node
// Golden token ids and decoded text from an independent tokenizer implementation
// (@huggingface/tokenizers, pure JS) for the C tokenizer tests.
//
// Usage: node tests/reference/tok_ref.mjs TOKENIZER_DIR TEXTS_JSON [OUT_JSON]
//   TOKENIZER_DIR holds tokenizer.json and tokenizer_config.json.
//   TEXTS_JSON is a JSON array of strings.
// Output (stdout or OUT_JSON): {"tokenizer": <dir basename>, "cases": [{"text", "ids",
//   "ids_special", "decoded", "decoded_skip"}]} where ids = encode(text,
//   add_special_tokens=false), ids_special = encode(text, add_special_tokens=true), decoded =
//   decode(ids_special, skip_special_tokens=false), decoded_skip = decode(ids_special,
//   skip_special_tokens=true). Decoding uses clean_up_tokenization_spaces=false, which is
//   what Hugging Face's Rust decoder (and vLLM's streaming detokenizer) does.
// The package is found through PD_NPM_CACHE (default <repo>/.cache/npm, filled by
// tests/npm_cache.sh).
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const cache = process.env.PD_NPM_CACHE || path.join(here, "..", "..", ".cache", "npm");
const pkg = path.join(cache, "node_modules", "@huggingface", "tokenizers", "dist", "tokenizers.mjs");
if (process.argv.length < 4) {
  console.error("usage: tok_ref.mjs TOKENIZER_DIR TEXTS_JSON [OUT_JSON]");
  process.exit(2);
}
if (!fs.existsSync(pkg)) {
  console.error(`tok_ref: ${pkg} not found (run tests/npm_cache.sh)`);
  process.exit(3);
}
const { Tokenizer } = await import(pathToFileURL(pkg).href);
const [dir, textsFile, outFile] = process.argv.slice(2);
const tj = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
const cfgPath = path.join(dir, "tokenizer_config.json");
const cfg = fs.existsSync(cfgPath) ? JSON.parse(fs.readFileSync(cfgPath, "utf8")) : {};
const tok = new Tokenizer(tj, cfg);
const texts = JSON.parse(fs.readFileSync(textsFile, "utf8"));
const dec = (ids, skip) =>
  ids.length === 0 ? "" : tok.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
const cases = texts.map((text) => {
  const ids = tok.encode(text, { add_special_tokens: false }).ids;
  const ids_special = tok.encode(text, { add_special_tokens: true }).ids;
  return { text, ids, ids_special, decoded: dec(ids_special, false), decoded_skip: dec(ids_special, true) };
});
const out = JSON.stringify({ tokenizer: path.basename(path.resolve(dir, "..")), cases }) + "\n";
if (outFile) fs.writeFileSync(outFile, out);
else process.stdout.write(out);
