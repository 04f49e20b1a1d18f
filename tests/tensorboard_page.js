// Read a TensorBoard dashboard as drawn (Polymer: shadow roots walked): its cards, each with its title,
// the SVG line paths drawn and their colours, the "Matches (n)" list of a custom chart; the runs ticked.
const dashboard = arguments[0];
const walk = (root, fn) => { for (const e of root.querySelectorAll('*')) { fn(e); if (e.shadowRoot) walk(e.shadowRoot, fn); } };
const skip = ['STYLE', 'SCRIPT', 'TEMPLATE'];
const text = (el) => {
  let s = '';
  const rec = (n) => {
    for (const c of n.childNodes) { if (c.nodeType === 3) s += ' ' + c.textContent; else if (!skip.includes(c.tagName)) rec(c); }
    if (n.shadowRoot) rec(n.shadowRoot);
  };
  rec(el);
  return s.replace(/\s+/g, ' ').trim();
};
const roots = [];
walk(document, e => { if (e.tagName.toLowerCase() === dashboard) roots.push(e); });
if (!roots.length) return JSON.stringify({cards: [], runs: '', ticked: 0, images: []});
const root = roots[0].shadowRoot || roots[0];
const cards = [];
walk(root, e => {
  const tag = e.tagName.toLowerCase();
  if (tag !== 'tf-scalar-card' && tag !== 'tf-custom-scalar-multi-line-chart-card') return;
  const colours = new Set(); let paths = 0; let heading = '';
  walk(e.shadowRoot || e, p => {
    const t = p.tagName.toLowerCase();
    if (t === 'path' && (p.getAttribute('class') || '').split(' ').includes('line') && (p.getAttribute('d') || '').length > 5) {
      paths += 1; colours.add(p.style.stroke || p.getAttribute('stroke') || '');
    }
    if (t === 'tf-card-heading' && !heading) heading = text(p);
  });
  const matches = /Matches \((\d+)\)/.exec(text(e));
  cards.push({title: heading, paths, colours: [...colours], matches: matches ? +matches[1] : null});
});
let runs = '', ticked = 0;
walk(root, e => {
  if (e.tagName.toLowerCase() !== 'tf-multi-checkbox') return;
  runs = text(e);
  walk(e.shadowRoot || e, c => { if (c.tagName.toLowerCase() === 'paper-checkbox' && c.hasAttribute('checked')) ticked += 1; });
});
const images = [];
walk(root, e => { if (e.tagName.toLowerCase() === 'img' && e.complete && e.naturalWidth > 0) images.push([e.naturalWidth, e.naturalHeight]); });
return JSON.stringify({cards, runs, ticked, images});
