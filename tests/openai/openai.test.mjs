// The official openai client against `moeserve serve` on the fixture model: completions and chat,
// whole and streamed, usage, stop strings, tools, and every error status the client maps.
// Run by CTest through run.sh, which passes MOESERVE (the binary) and MODEL_DIR (the fixture).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import OpenAI from 'openai';

const MOESERVE = process.env.MOESERVE;
const MODEL_DIR = process.env.MODEL_DIR;
const MODEL = 'qwen3_moe';
const PROMPT_IDS = [1, 17, 42, 99, 7];

// Starts `moeserve serve ARGS` on free ports; resolves once it serves, with its HTTP port.
function startServer(args) {
  return new Promise((resolve, reject) => {
    const child = spawn(MOESERVE, ['serve', '--model', MODEL_DIR, '--listen', '127.0.0.1:0', '--http', '127.0.0.1:0',
                                   '--kv-cache-mb', '64', '--threads', '2', '--no-request-log', ...args],
                        { stdio: ['ignore', 'pipe', 'pipe'] });
    let stderr = '';
    let httpPort = 0;
    const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error(`serve did not start:\n${stderr}`)); }, 60000);
    child.stderr.on('data', (d) => {
      stderr += d;
      const m = stderr.match(/HTTP on port (\d+)/);
      if (m) httpPort = Number(m[1]);
    });
    child.stdout.on('data', (d) => {
      if (String(d).includes('serving on port') && httpPort !== 0) {
        clearTimeout(timer);
        resolve({ child, port: httpPort, stderr: () => stderr });
      }
    });
    child.on('exit', (code) => { clearTimeout(timer); reject(new Error(`serve exited with ${code}:\n${stderr}`)); });
  });
}

function stopServer(server) {
  return new Promise((resolve) => {
    if (server.child.exitCode !== null) return resolve();
    server.child.removeAllListeners('exit');
    server.child.on('exit', () => resolve());
    server.child.kill('SIGTERM');
  });
}

let main;      // --max-seqs 1 --max-queue 0 (a second request at once is 429), --max-request-bytes 4096
let keyed;     // --api-key-file
let client;
let servesText = false;

before(async () => {
  main = await startServer(['--max-seqs', '1', '--max-queue', '0', '--max-request-bytes', '4096']);
  const dir = mkdtempSync(join(tmpdir(), 'moeserve-openai-'));
  writeFileSync(join(dir, 'keys'), 'sk-moeserve-test\n');
  keyed = await startServer(['--api-key-file', join(dir, 'keys')]);
  client = new OpenAI({ baseURL: `http://127.0.0.1:${main.port}/v1`, apiKey: 'unused', maxRetries: 0 });
  try {
    await client.completions.create({ model: MODEL, prompt: 'hello', max_tokens: 1 });
    servesText = true;
  } catch (e) {
    assert.equal(e.status, 400);
    assert.match(e.message, /tokenizer/);
  }
});

after(async () => {
  if (main) await stopServer(main);
  if (keyed) await stopServer(keyed);
});

test('models list the served model', async () => {
  const models = await client.models.list();
  assert.equal(models.data.length, 1);
  assert.equal(models.data[0].id, MODEL);
  assert.equal(models.data[0].owned_by, 'moeserve');
  assert.ok(models.data[0].max_model_len > 0);
  const one = await client.models.retrieve(MODEL);
  assert.equal(one.id, MODEL);
});

test('completion of token ids, whole and streamed, with usage', async () => {
  const whole = await client.completions.create({ model: MODEL, prompt: PROMPT_IDS, max_tokens: 6, temperature: 0,
                                                  ignore_eos: true, return_token_ids: true });
  assert.equal(whole.object, 'text_completion');
  assert.equal(whole.choices.length, 1);
  assert.equal(whole.choices[0].finish_reason, 'length');
  assert.deepEqual(whole.usage, { prompt_tokens: 5, completion_tokens: 6, total_tokens: 11,
                                  prompt_tokens_details: { cached_tokens: 0 },
                                  completion_tokens_details: { accepted_prediction_tokens: 0,
                                                               rejected_prediction_tokens: 0 } });
  const stream = await client.completions.create({ model: MODEL, prompt: PROMPT_IDS, max_tokens: 6, temperature: 0,
                                                   ignore_eos: true, return_token_ids: true, stream: true,
                                                   stream_options: { include_usage: true } });
  const tokens = [];
  let text = '';
  let finish = null;
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      text += choice.text;
      tokens.push(...(choice.token_ids ?? []));
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  assert.equal(finish, 'length');
  assert.deepEqual(tokens, whole.choices[0].token_ids);
  assert.equal(text, whole.choices[0].text);
  assert.equal(usage.completion_tokens, 6);
  assert.equal(usage.prompt_tokens, 5);
});

test('text completion and stop strings', async (t) => {
  if (!servesText) return t.skip('this moeserve has no tokenizer library');
  const whole = await client.completions.create({ model: MODEL, prompt: 'Once upon a time', max_tokens: 12,
                                                  temperature: 0, ignore_eos: true });
  const text = whole.choices[0].text;
  assert.equal(whole.usage.completion_tokens, 12);
  // The stop string: the character whose first occurrence comes last (a random-weight model
  // writes any characters), so that the cut text is as long as it can be.
  let stop = null;
  let at = 0;
  for (const c of new Set(Array.from(text))) {
    if (text.indexOf(c) > at) { at = text.indexOf(c); stop = c; }
  }
  assert.ok(stop !== null, `no character to stop at in ${JSON.stringify(text)}`);
  {
    const stopped = await client.completions.create({ model: MODEL, prompt: 'Once upon a time', max_tokens: 12,
                                                      temperature: 0, ignore_eos: true, stop: [stop] });
    assert.equal(stopped.choices[0].finish_reason, 'stop');
    assert.equal(stopped.choices[0].text, text.slice(0, text.indexOf(stop)));
  }
});

test('chat, whole and streamed, and a tools request', async (t) => {
  const request = { model: MODEL, messages: [{ role: 'user', content: 'Hi there' }], max_tokens: 5, temperature: 0 };
  if (!servesText) {
    await assert.rejects(client.chat.completions.create(request),
                         (e) => e.status === 400 && /tokenizer/.test(e.message));
    return t.skip('this moeserve has no tokenizer library');
  }
  const whole = await client.chat.completions.create(request);
  assert.equal(whole.object, 'chat.completion');
  assert.equal(whole.choices[0].message.role, 'assistant');
  assert.ok(whole.usage.prompt_tokens > 3);
  const stream = await client.chat.completions.create({ ...request, stream: true,
                                                        stream_options: { include_usage: true } });
  let finish = null;
  let usage = null;
  let role = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      role = role ?? choice.delta.role;
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  assert.equal(role, 'assistant');
  assert.ok(finish);
  assert.ok(usage.completion_tokens >= 1);
  const tools = await client.chat.completions.create({
    ...request,
    tools: [{ type: 'function', function: { name: 'get_weather', description: 'Weather in a city',
                                            parameters: { type: 'object', properties: { city: { type: 'string' } } } } }],
    tool_choice: 'auto',
  });
  assert.equal(tools.choices.length, 1);
});

test('400: n > 1, response_format, malformed JSON; 404: unknown model', async () => {
  await assert.rejects(client.completions.create({ model: 'gpt-4', prompt: PROMPT_IDS }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError, String(e));
    assert.equal(e.status, 404);
    assert.match(e.message, /does not exist/);
    return true;
  });
  for (const [body, pattern] of [
    [{ model: MODEL, prompt: PROMPT_IDS, n: 2 }, /n: only 1/],
    [{ model: MODEL, prompt: PROMPT_IDS, response_format: { type: 'json_schema', json_schema: { name: 'n', schema: { type: 'integer', minimum: 1 } } } },
     /the keyword 'minimum' cannot be enforced/],
  ]) {
    await assert.rejects(client.completions.create(body), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, String(e));
      assert.equal(e.status, 400);
      assert.equal(e.type, 'invalid_request_error');
      assert.match(e.message, pattern);
      return true;
    });
  }
  const response = await fetch(`http://127.0.0.1:${main.port}/v1/completions`,
                               { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"prompt": [1,' });
  assert.equal(response.status, 400);
  const error = (await response.json()).error;
  assert.match(error.message, /request body:1:\d+: invalid JSON/);
  assert.equal(error.param, null);
});

test('401 without or with a wrong API key', async () => {
  const base = `http://127.0.0.1:${keyed.port}/v1`;
  const wrong = new OpenAI({ baseURL: base, apiKey: 'sk-wrong', maxRetries: 0 });
  await assert.rejects(wrong.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  const right = new OpenAI({ baseURL: base, apiKey: 'sk-moeserve-test', maxRetries: 0 });
  const models = await right.models.list();
  assert.equal(models.data[0].id, MODEL);
});

test('404 for an unknown path', async () => {
  await assert.rejects(client.get('/nothing/here'), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError, String(e));
    assert.match(e.message, /no route for GET \/v1\/nothing\/here/);
    return true;
  });
});

test('413 for a body over --max-request-bytes', async () => {
  await assert.rejects(client.completions.create({ model: MODEL, prompt: Array(3000).fill(3) }), (e) => {
    assert.equal(e.status, 413, String(e));
    assert.match(e.message, /limit of 4096 bytes/);
    return true;
  });
});

test('429 when the queue is full', async () => {
  const long = await client.completions.create({ model: MODEL, prompt: PROMPT_IDS, max_tokens: 1500,
                                                 ignore_eos: true, stream: true });
  const iterator = long[Symbol.asyncIterator]();
  await iterator.next();  // it runs, holding the only slot
  await assert.rejects(client.completions.create({ model: MODEL, prompt: PROMPT_IDS, max_tokens: 1 }), (e) => {
    assert.ok(e instanceof OpenAI.RateLimitError, String(e));
    assert.equal(e.status, 429);
    return true;
  });
  long.controller.abort();  // the client leaves mid-stream: the server cancels the request
});

test('503 while draining', async () => {
  const draining = await startServer(['--drain-seconds', '5']);
  const c = new OpenAI({ baseURL: `http://127.0.0.1:${draining.port}/v1`, apiKey: 'unused', maxRetries: 0 });
  const long = await c.completions.create({ model: MODEL, prompt: PROMPT_IDS, max_tokens: 1900, ignore_eos: true,
                                            stream: true });
  const iterator = long[Symbol.asyncIterator]();
  await iterator.next();
  const exited = stopServer(draining);  // SIGTERM: the server drains, the long stream runs on
  await new Promise((r) => setTimeout(r, 200));
  await assert.rejects(c.completions.create({ model: MODEL, prompt: PROMPT_IDS, max_tokens: 1 }), (e) => {
    // The drain may already have closed the listener on a fast machine.
    assert.ok(e.status === 503 || e instanceof OpenAI.APIConnectionError, String(e));
    if (e.status === 503) assert.match(e.message, /shutting down/);
    return true;
  });
  long.controller.abort();
  await exited;
});

test('structured outputs: response_format with a schema, tool_choice required, cached_tokens on a second turn', async (t) => {
  if (!servesText) return t.skip('this build has no tokenizer library');
  const messages = [{ role: 'system', content: 'You answer in JSON. '.repeat(20) }, { role: 'user', content: 'Weather?' }];
  const schema = {
    type: 'object',
    properties: { city: { type: 'string', maxLength: 6 }, unit: { enum: ['c', 'f'] } },
    required: ['city', 'unit'],
    additionalProperties: false,
  };
  const first = await client.chat.completions.create({
    model: MODEL, messages, temperature: 1, seed: 3, max_tokens: 200,
    response_format: { type: 'json_schema', json_schema: { name: 'weather', strict: true, schema } },
  });
  const parsed = JSON.parse(first.choices[0].message.content);
  assert.equal(typeof parsed.city, 'string');
  assert.ok(['c', 'f'].includes(parsed.unit), JSON.stringify(parsed));
  assert.deepEqual(Object.keys(parsed).sort(), ['city', 'unit']);

  const tools = await client.chat.completions.create({
    model: MODEL, messages, temperature: 1, seed: 4, max_tokens: 200, tool_choice: 'required',
    tools: [{ type: 'function', function: { name: 'get_weather',
                                            parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 5 } },
                                                          required: ['city'] } } }],
  });
  assert.equal(tools.choices[0].finish_reason, 'tool_calls');
  const calls = tools.choices[0].message.tool_calls;
  assert.ok(calls.length >= 1);
  assert.equal(calls[0].function.name, 'get_weather');
  assert.equal(typeof JSON.parse(calls[0].function.arguments).city, 'string');

  const second = await client.chat.completions.create({
    model: MODEL, max_tokens: 2,
    messages: [...messages, { role: 'assistant', content: first.choices[0].message.content }, { role: 'user', content: 'And tomorrow?' }],
  });
  assert.ok(second.usage.prompt_tokens_details.cached_tokens > 0, JSON.stringify(second.usage));
});
