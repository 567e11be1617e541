// A small SVG line chart of the last few minutes: one polyline per series, a y axis from 0 to a round maximum,
// and a legend that holds each series' latest value as text (what a screen reader gets, with the figure's label).

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 480;
const HEIGHT = 160;
const PAD = { left: 44, right: 8, top: 10, bottom: 20 };

function svg(tag, attrs = {}, parent = null) {
  const el = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
  if (parent) parent.appendChild(el);
  return el;
}

// The smallest of 1, 2, 2.5, 5 × 10^k at or above `value`, so the axis labels stay readable.
function niceCeiling(value) {
  if (!(value > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
  return 10 * power;
}

// A value for a label: 3 significant digits at most, no trailing zeros ("–" for none).
export function formatNumber(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  const abs = Math.abs(value);
  if (abs >= 10000) return `${Math.round(value / 1000)}k`;
  if (abs >= 1000) return `${Number((value / 1000).toFixed(1))}k`;
  const digits = abs >= 100 ? 0 : abs >= 10 ? 1 : 2;
  return String(Number(value.toFixed(digits)));
}

export class LineChart {
  // figure: a <figure> holding a <figcaption>; series: [{label, color}]; unit: appended to values;
  // yMax: a fixed top (KV use: 100 %), else it follows the data; windowS: the seconds shown.
  constructor(figure, { series, unit = "", yMax = null, windowS = 300 }) {
    this.series = series;
    this.unit = unit;
    this.yMax = yMax;
    this.windowS = windowS;
    this.points = []; // [{t (s), values: [number|null per series]}]
    this.title = figure.querySelector("figcaption").textContent;
    this.root = svg("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img", class: "chart" });
    this.axis = svg("g", { class: "axis" }, this.root);
    this.lines = series.map((s) => svg("polyline", { fill: "none", stroke: s.color, "stroke-width": 2,
      "stroke-linejoin": "round" }, this.root));
    figure.insertBefore(this.root, figure.querySelector("figcaption").nextSibling);
    this.legend = document.createElement("ul");
    this.legend.className = "legend";
    this.values = series.map((s) => {
      const item = document.createElement("li");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = s.color;
      swatch.setAttribute("aria-hidden", "true");
      const value = document.createElement("span");
      value.className = "value";
      value.textContent = "–";
      item.append(swatch, `${s.label}: `, value);
      this.legend.appendChild(item);
      return value;
    });
    figure.appendChild(this.legend);
    this.render();
  }

  // values: one per series, null where this scrape has none (a rate's first scrape).
  push(seconds, values) {
    this.points.push({ t: seconds, values });
    while (this.points.length && this.points[0].t < seconds - this.windowS) this.points.shift();
    values.forEach((v, i) => {
      if (v !== null) this.values[i].textContent = `${formatNumber(v)}${this.unit}`;
    });
    this.render();
  }

  render() {
    const seen = this.points.flatMap((p) => p.values.filter((v) => v !== null && Number.isFinite(v)));
    const top = this.yMax ?? niceCeiling(Math.max(0, ...seen));
    const now = this.points.length ? this.points[this.points.length - 1].t : 0;
    // The x axis grows with the history, from one minute up to the window, so a fresh page is not all blank.
    const span = Math.min(this.windowS, Math.max(60, this.points.length ? now - this.points[0].t : 0));
    const plotW = WIDTH - PAD.left - PAD.right;
    const plotH = HEIGHT - PAD.top - PAD.bottom;
    const x = (t) => PAD.left + plotW * (1 - (now - t) / span);
    const y = (v) => PAD.top + plotH * (1 - Math.min(v, top) / top);
    this.axis.replaceChildren();
    for (const fraction of [0, 0.5, 1]) {
      const value = top * fraction;
      svg("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y(value), y2: y(value), class: "grid" }, this.axis);
      const label = svg("text", { x: PAD.left - 6, y: y(value) + 4, "text-anchor": "end" }, this.axis);
      label.textContent = `${formatNumber(value)}${this.unit}`;
    }
    const oldest = span < 120 ? `−${Math.round(span)} s` : `−${Math.round(span / 60)} min`;
    for (const [t, anchor, text] of [[now - span, "start", oldest], [now, "end", "now"]]) {
      const label = svg("text", { x: x(t), y: HEIGHT - 4, "text-anchor": anchor }, this.axis);
      label.textContent = text;
    }
    this.lines.forEach((line, i) => {
      const coords = this.points.filter((p) => p.values[i] !== null && Number.isFinite(p.values[i]))
        .map((p) => `${x(p.t).toFixed(1)},${y(p.values[i]).toFixed(1)}`);
      line.setAttribute("points", coords.join(" "));
    });
    const latest = this.series.map((s, i) => `${s.label} ${this.values[i].textContent}`).join(", ");
    this.root.setAttribute("aria-label", `${this.title}; now ${latest}`);
  }
}
