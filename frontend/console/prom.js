// The Prometheus text exposition format (version 0.0.4), as /metrics serves it: one sample per line,
// `name{label="value",...} value [timestamp]`, `#` lines are HELP/TYPE comments.

const NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*/;
const LABEL_NAME = /^[a-zA-Z_][a-zA-Z0-9_]*/;
const ESCAPES = { "\\": "\\", '"': '"', n: "\n" };

// [{name, labels: {..}, value}] in the order of the text; a line that does not parse throws, naming it.
export function parsePrometheus(text) {
  const samples = [];
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (line && !line.startsWith("#")) samples.push(parseLine(line));
  }
  return samples;
}

function parseLine(line) {
  const name = line.match(NAME)?.[0];
  if (!name) throw new Error(`metrics: no metric name in ${JSON.stringify(line)}`);
  let rest = line.slice(name.length);
  const labels = {};
  if (rest.startsWith("{")) {
    rest = rest.slice(1).trimStart();
    while (!rest.startsWith("}")) {
      const label = rest.match(LABEL_NAME)?.[0];
      if (!label || rest[label.length] !== "=" || rest[label.length + 1] !== '"') {
        throw new Error(`metrics: bad label in ${JSON.stringify(line)}`);
      }
      // The value runs to the first unescaped quote; \\, \" and \n are its only escapes.
      let i = label.length + 2;
      let value = "";
      while (i < rest.length && rest[i] !== '"') {
        if (rest[i] === "\\" && i + 1 < rest.length) {
          value += ESCAPES[rest[i + 1]] ?? `\\${rest[i + 1]}`;
          i += 2;
        } else {
          value += rest[i++];
        }
      }
      if (i >= rest.length) throw new Error(`metrics: unterminated label value in ${JSON.stringify(line)}`);
      labels[label] = value;
      rest = rest.slice(i + 1).trimStart();
      if (rest.startsWith(",")) rest = rest.slice(1).trimStart();
      else if (!rest.startsWith("}")) throw new Error(`metrics: expected , or } in ${JSON.stringify(line)}`);
    }
    rest = rest.slice(1);
  }
  const [valueText] = rest.trim().split(/\s+/);
  const value = parseValue(valueText);
  if (Number.isNaN(value) && valueText !== "NaN") throw new Error(`metrics: bad value in ${JSON.stringify(line)}`);
  return { name, labels, value };
}

function parseValue(text) {
  if (text === "+Inf" || text === "Inf") return Infinity;
  if (text === "-Inf") return -Infinity;
  if (text === "NaN") return NaN;
  return text === undefined || text === "" ? NaN : Number(text);
}

// The sum of every series of `name` (0 when there is none): totals over dp_rank and the like.
export function total(samples, name) {
  return samples.reduce((sum, s) => (s.name === name ? sum + s.value : sum), 0);
}

// label value -> the sum of the series of `name` that carry it.
export function byLabel(samples, name, label) {
  const out = new Map();
  for (const s of samples) {
    if (s.name === name && label in s.labels) out.set(s.labels[label], (out.get(s.labels[label]) ?? 0) + s.value);
  }
  return out;
}

// Per-second rates of counters between successive scrapes. A series seen for the first time, or one that went
// down (the server restarted, or an adapter was unloaded and loaded again), has no rate until its next scrape.
export class RateTracker {
  constructor() {
    this.last = new Map(); // key -> {value, t}
  }

  // seconds: the scrape's time; returns the rate since the previous scrape, or null.
  rate(key, value, seconds) {
    const previous = this.last.get(key);
    this.last.set(key, { value, t: seconds });
    if (!previous || value < previous.value || seconds <= previous.t) return null;
    return (value - previous.value) / (seconds - previous.t);
  }
}
