// Numbers with their units, and a tiny DOM builder. Text goes in with textContent only:
// request ids and model names come from clients and must never become markup.

export const DASH = "—";

export function ms(value, digits = 1) {
  if (value === null || value === undefined || !Number.isFinite(value)) return DASH;
  if (value >= 1000) return `${(value / 1000).toFixed(2)} s`;
  if (value < 0.1 && value > 0) return `${(value * 1000).toFixed(0)} µs`;
  return `${value.toFixed(digits)} ms`;
}

export function seconds(value) {
  return value === null || value === undefined ? DASH : ms(value * 1000);
}

export function pct(value, digits = 1) {
  if (value === null || value === undefined || !Number.isFinite(value)) return DASH;
  return `${value.toFixed(digits)} %`;
}

export function ratioPct(part, whole) {
  return whole > 0 ? pct((100 * part) / whole) : DASH;
}

export function rate(value, unit = "/s") {
  if (value === null || value === undefined || !Number.isFinite(value)) return DASH;
  return `${value < 10 ? value.toFixed(2) : value.toFixed(0)} ${unit}`;
}

export function count(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return DASH;
  return Math.round(value).toLocaleString("en-US");
}

export function bytes(value) {
  if (value === null || value === undefined) return DASH;
  const units = ["B", "KiB", "MiB", "GiB"];
  let v = value;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${Number.isInteger(v) ? v : v.toFixed(1)} ${units[i]}`;
}

export function clock(unixSeconds) {
  if (!unixSeconds) return DASH;
  const d = new Date(unixSeconds * 1000);
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

export function bucketLabel(le) {
  if (le === "+Inf") return "+∞";
  const v = le * 1000;
  return v >= 1 ? `${+v.toFixed(1)}` : `${+v.toFixed(2)}`;
}

// el("td", {class: "num", title: "x"}, "text" | Node | [children])
export function el(tag, attrs = {}, children = []) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  const list = Array.isArray(children) ? children : [children];
  for (const child of list) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function setText(root, selector, text) {
  const node = root.querySelector(selector);
  if (node && node.textContent !== text) node.textContent = text;
}

// A row of "label: value" tiles; update() sets the values by key.
export class Stats {
  constructor(container, tiles) {
    this.values = new Map();
    for (const [key, label, hint] of tiles) {
      const value = el("span", { class: "value" }, DASH);
      const bar = el("span", { class: "bar" }, el("span", { class: "fill" }));
      const tile = el("div", { class: "stat", title: hint || null, dataset: { key } }, [
        el("span", { class: "label" }, label),
        value,
        bar,
      ]);
      bar.hidden = true;
      container.append(tile);
      this.values.set(key, { value, bar });
    }
  }

  set(key, text, fraction = null) {
    const entry = this.values.get(key);
    if (!entry) return;
    if (entry.value.textContent !== text) entry.value.textContent = text;
    entry.bar.hidden = fraction === null;
    if (fraction !== null) {
      const width = `${Math.max(0, Math.min(1, fraction)) * 100}%`;
      entry.bar.firstChild.style.width = width;
      entry.bar.classList.toggle("high", fraction >= 0.9);
    }
  }
}
