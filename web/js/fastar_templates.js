// FastAR: the bundled demos first in the template browser (template_order.js), whatever order the server lists the
// pack's workflows in. Wraps the frontend's public api object; any other pack's list is left as it comes.
import { api } from "../../../scripts/api.js";
import { DEMO_PREFIX, demosFirst } from "./template_order.js";

const listTemplates = api.getWorkflowTemplates.bind(api);

api.getWorkflowTemplates = async () => {
  const packs = await listTemplates();
  for (const [pack, names] of Object.entries(packs)) {
    if (Array.isArray(names) && names.some((name) => name.startsWith(DEMO_PREFIX))) packs[pack] = demosFirst(names);
  }
  return packs;
};
