// FastAR: the order of the pack's example workflows in ComfyUI's template browser. The server lists them in the
// order it meets the files (the disk's, or a set's), so the bundled demos, which need no download, can come last;
// this puts them first, each group by name.
export const DEMO_PREFIX = "fastar_demo_";

export function demosFirst(names) {
  const demo = (name) => name.startsWith(DEMO_PREFIX);
  return [...names.filter(demo).sort(), ...names.filter((name) => !demo(name)).sort()];
}
