// Run a GGUF in llama.cpp (through node-llama-cpp) on token ids given by Python, print one JSON object.
//
// Usage: node .../prunelight/engines/llama_cpp_eval.mjs request.json (prunelight.llama_cpp.run_llama_cpp runs it)
// The request: {"model": "x.gguf", "threads": 2, "greedy": {"prompts": [[ids...]], "new_tokens": 16},
//               "perplexity": {"windows": [[ids...]]}, "speed": {"prompt": [ids...], "new_tokens": 64, "runs": 5}}
// Every part is optional. Token ids come from Python (transformers' tokenizer), so llama.cpp and transformers
// see the same tokens whatever each tokenizer would have produced from the text.
// The package is found through PRUNELIGHT_LLAMA_NODE (the folder npm installed node-llama-cpp into).
import {readFileSync} from "node:fs";
import {createRequire} from "node:module";
import path from "node:path";
import {pathToFileURL} from "node:url";

const root = process.env.PRUNELIGHT_LLAMA_NODE;
if (!root) {
    console.error("PRUNELIGHT_LLAMA_NODE is not set: install with `npm install --prefix DIR node-llama-cpp@3.21.1`");
    process.exit(2);
}
const require = createRequire(path.join(root, "package.json"));
const {getLlama, LlamaLogLevel} = await import(pathToFileURL(require.resolve("node-llama-cpp")).href);

const request = JSON.parse(readFileSync(process.argv[2], "utf8"));
const threads = request.threads ?? 2;
const llama = await getLlama({gpu: false, build: "never", logLevel: LlamaLogLevel.error, maxThreads: threads});
const model = await llama.loadModel({modelPath: request.model, useMmap: true});
const out = {llama_cpp: llama.llamaCppRelease};

function argmax(probabilities) {
    // node-llama-cpp sorts the map from the highest probability to the lowest
    return probabilities.entries().next().value[0];
}

async function withSequence(size, fn) {
    const context = await model.createContext({contextSize: size, batchSize: size, threads, sequences: 1});
    try {
        return await fn(context.getSequence());
    } finally {
        await context.dispose();
    }
}

if (request.greedy) {
    const {prompts, new_tokens: n} = request.greedy;
    out.greedy = [];
    for (const prompt of prompts) {
        const ids = await withSequence(prompt.length + n + 8, async (seq) => {
            const got = [];
            let items = prompt.map((t, i) => (i === prompt.length - 1 ? [t, {generateNext: {probabilities: true}}] : t));
            for (let step = 0; step < n; step++) {
                const res = await seq.controlledEvaluate(items);
                const next = argmax(res[res.length - 1].next.probabilities);
                got.push(next);
                items = [[next, {generateNext: {probabilities: true}}]];
            }
            return got;
        });
        out.greedy.push(ids);
    }
}

if (request.perplexity) {
    // Mean negative log-likelihood of every token after the first of each window (each window its own context).
    let nll = 0, count = 0;
    for (const w of request.perplexity.windows) {
        await withSequence(w.length + 8, async (seq) => {
            const items = w.map((t, i) => (i < w.length - 1 ? [t, {generateNext: {probabilities: true}}] : t));
            const res = await seq.controlledEvaluate(items);
            for (let i = 0; i < w.length - 1; i++) {
                const p = res[i].next.probabilities.get(w[i + 1]) ?? 0;
                nll -= Math.log(Math.max(p, 1e-30));
                count += 1;
            }
        });
    }
    out.perplexity = {nll: nll / count, tokens: count, ppl: Math.exp(nll / count)};
}

if (request.speed) {
    // Prompt processing (one batch) and generation (one token at a time, greedy), each timed on its own.
    const {prompt, new_tokens: n, runs} = request.speed;
    const promptTps = [], genTps = [];
    for (let r = -1; r < runs; r++) {  // run -1 warms the caches (mmap pages, kernels) and is not recorded
        await withSequence(prompt.length + n + 8, async (seq) => {
            // the prompt less its last token in one batch; that token starts generation (one token per step)
            const head = prompt.slice(0, -1);
            let t0 = process.hrtime.bigint();
            await seq.evaluateWithoutGeneratingNewTokens(head);
            const promptS = Number(process.hrtime.bigint() - t0) / 1e9;
            let produced = 0;
            t0 = process.hrtime.bigint();
            for await (const token of seq.evaluate([prompt[prompt.length - 1]], {temperature: 0})) {
                produced += 1;
                if (produced >= n) break;
            }
            if (r >= 0) {
                promptTps.push(head.length / promptS);
                genTps.push(produced / (Number(process.hrtime.bigint() - t0) / 1e9));
            }
        });
    }
    const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
    out.speed = {prompt_tps: median(promptTps), gen_tps: median(genTps), prompt_runs: promptTps, gen_runs: genTps,
                 prompt_tokens: prompt.length - 1, new_tokens: n, threads};
}

await model.dispose();
await llama.dispose();
console.log(JSON.stringify(out));
